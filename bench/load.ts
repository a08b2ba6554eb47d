// The load generator: autocannon in its own process, so that it never shares an event loop with
// the server it measures. bench/run.ts forks it and sends one job at a time over IPC; each job
// answers with one LoadResult.

import autocannon from 'autocannon'

/** Fires one request shape at `url + path` for `seconds`, or `amount` requests. */
export type LoadJob = {
  kind: 'load'
  url: string
  path: string
  method: 'GET' | 'POST'
  /** One body for every request, or… */
  body?: string
  /** …one body per request, in order (each token exchange needs its own code); reused from the start when they run out. */
  bodies?: string[]
  seconds?: number
  amount?: number
  connections: number
}

/** Mixed traffic for `seconds`: each connection signs in, exchanges, introspects, revokes, again and again. */
export type SoakJob = {
  kind: 'soak'
  url: string
  authorizationPath: string
  tokenBody: string
  seconds: number
  connections: number
}

export type LoadResult = {
  requests: number
  seconds: number
  rps: number
  p50Ms: number
  p99Ms: number
  status4xx: number
  status5xx: number
  errors: number
  resets: number
}

const FORM = { 'content-type': 'application/x-www-form-urlencoded' }

async function runLoad(job: LoadJob): Promise<LoadResult> {
  const bodies = job.bodies
  let next = 0
  const request: autocannon.Request = {
    method: job.method,
    path: job.path,
    headers: job.method === 'POST' ? FORM : {},
    body: job.body,
  }
  if (bodies !== undefined) request.setupRequest = (req) => ({ ...req, body: bodies[next++ % bodies.length] })
  return timed({
    url: job.url,
    connections: job.connections,
    ...(job.amount === undefined ? { duration: job.seconds ?? 5 } : { amount: job.amount }),
    requests: [request],
  })
}

/**
 * Runs autocannon and times it from its start to its last response. autocannon itself only
 * reports once a second: a run of `amount` requests ends with up to a second of idle waiting
 * for that report, which would count against the server measured.
 */
function timed(options: autocannon.Options): Promise<LoadResult> {
  return new Promise((resolve, reject) => {
    const started = performance.now()
    let lastResponse = started
    const instance = autocannon(options, (err, result) =>
      err ? reject(err) : resolve(summarize(result, (lastResponse - started) / 1000)),
    )
    instance.on('response', () => (lastResponse = performance.now()))
  })
}

/** What a `setupRequest` returns to start the loop of requests again: autocannon takes any falsy value. */
const RESTART = undefined as unknown as autocannon.Request

/** A response header by name, whatever its case: autocannon keeps the case the server sent. */
function header(headers: autocannon.Request['headers'], name: string): string {
  const value = Object.entries(headers ?? {}).find(([key]) => key.toLowerCase() === name)?.[1]
  return String(Array.isArray(value) ? value[0] : (value ?? ''))
}

type FlowContext = { request?: string; csrf?: string; cookie?: string; code?: string; token?: string }

/** One sign-in per loop of the list; a step that finds nothing to work with starts the loop again. */
async function runSoak(job: SoakJob): Promise<LoadResult> {
  const introspect: autocannon.Request = {
    method: 'POST',
    path: '/introspect',
    setupRequest: (req, context: FlowContext) =>
      context.token === undefined ? RESTART : { ...req, headers: FORM, body: `token=${context.token}` },
  }
  const requests: autocannon.Request[] = [
    {
      method: 'GET',
      path: job.authorizationPath,
      onResponse: (_status, body, context: FlowContext, headers) => {
        context.request = /name="request" value="([^"]+)"/.exec(body)?.[1]
        context.csrf = /name="csrf" value="([^"]+)"/.exec(body)?.[1]
        context.cookie = header(headers, 'set-cookie').split(';')[0]
      },
    },
    {
      method: 'POST',
      path: '/auth/consent',
      setupRequest: (req, context: FlowContext) =>
        context.request === undefined
          ? RESTART
          : {
              ...req,
              headers: { ...FORM, cookie: context.cookie },
              body: `request=${context.request}&csrf=${context.csrf}&scope=profile&scope=create&decision=approve`,
            },
      onResponse: (_status, _body, context: FlowContext, headers) => {
        context.code = /[?&]code=([^&]+)/.exec(header(headers, 'location'))?.[1]
      },
    },
    {
      method: 'POST',
      path: '/token',
      setupRequest: (req, context: FlowContext) =>
        context.code === undefined
          ? RESTART
          : { ...req, headers: FORM, body: job.tokenBody.replace('CODE', context.code) },
      onResponse: (_status, body, context: FlowContext) => {
        context.token = /"access_token":"([^"]+)"/.exec(body)?.[1]
      },
    },
    introspect,
    introspect,
    introspect,
    introspect,
    { method: 'GET', path: '/.well-known/oauth-authorization-server' },
    {
      method: 'POST',
      path: '/revoke',
      setupRequest: (req, context: FlowContext) => ({ ...req, headers: FORM, body: `token=${context.token}` }),
    },
    introspect,
    { method: 'GET', path: '/' },
  ]
  return timed({ url: job.url, connections: job.connections, duration: job.seconds, requests })
}

/** The figures of one run; `seconds` is measured here, since autocannon's own duration is rounded to whole seconds. */
function summarize(result: autocannon.Result, seconds: number): LoadResult {
  return {
    requests: result.requests.total,
    seconds,
    rps: result.requests.total / seconds,
    p50Ms: result.latency.p50,
    p99Ms: result.latency.p99,
    status4xx: result['4xx'],
    status5xx: result['5xx'],
    errors: result.errors,
    resets: result.resets,
  }
}

process.on('message', async (job: LoadJob | SoakJob) => {
  const result = job.kind === 'soak' ? await runSoak(job) : await runLoad(job)
  process.send?.(result)
})
