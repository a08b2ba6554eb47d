// The client side of the bench's cold and paced figures: requests sent from the bench process
// itself, few enough that it never becomes the limit. A real client sends one token exchange and
// waits for the answer; a personal server sees a few requests a second, not ten connections
// firing as fast as they can. So:
//
// - `oneAtATime` sends each request once the previous answer has arrived, over one kept-alive
//   connection, and reads the server's CPU time at chosen counts (after 100, after 1,000);
// - `atRate` sends at a fixed rate whatever the answers take (an open loop), over as many
//   connections as that needs;
// - `startToFirstAnswer` starts a server the way its user does and times the first answer.

import { spawn } from 'node:child_process'
import { Agent, createServer, request } from 'node:http'
import type { AddressInfo } from 'node:net'

/** The server's CPU time used so far, in microseconds, all threads (bench/probe.ts). */
export type CpuReader = () => Promise<number>

export type PacedResult = {
  requests: number
  seconds: number
  rps: number
  p50Ms: number
  p99Ms: number
  /** Answers with another status than 200, and requests that failed. */
  failures: number
  cpuMicrosPerRequest: number
}

/** One POST of a form, timed; resolves with the status (0 when the request failed). */
function post(agent: Agent, url: string, path: string, body: string): Promise<number> {
  return new Promise((resolve) => {
    const req = request(
      `${url}${path}`,
      {
        method: 'POST',
        agent,
        headers: { 'Content-Type': 'application/x-www-form-urlencoded', 'Content-Length': Buffer.byteLength(body) },
      },
      (res) => {
        res.resume()
        res.on('end', () => resolve(res.statusCode ?? 0))
        res.on('error', () => resolve(0))
      },
    )
    req.on('error', () => resolve(0))
    req.end(body)
  })
}

function percentile(sorted: number[], p: number): number {
  return sorted.length === 0 ? 0 : sorted[Math.min(sorted.length - 1, Math.floor((sorted.length * p) / 100))]
}

function summarize(latencies: number[], failures: number, seconds: number, cpuMicros: number): PacedResult {
  const sorted = [...latencies].sort((a, b) => a - b)
  return {
    requests: latencies.length,
    seconds,
    rps: latencies.length / seconds,
    p50Ms: percentile(sorted, 50),
    p99Ms: percentile(sorted, 99),
    failures,
    cpuMicrosPerRequest: cpuMicros / latencies.length,
  }
}

/**
 * Sends one request per body, each once the previous one is answered, over one connection; and
 * measures each stretch up to a checkpoint (e.g. [100, 1000]: the first 100, then the next 900)
 * on its own. Returns one result per stretch, and the whole.
 */
export async function oneAtATime(
  url: string,
  path: string,
  bodies: string[],
  cpu: CpuReader,
  checkpoints: number[] = [bodies.length],
): Promise<{ stretches: PacedResult[]; whole: PacedResult }> {
  const agent = new Agent({ keepAlive: true, maxSockets: 1 })
  const stretches: PacedResult[] = []
  const all: number[] = []
  let failures = 0
  const startCpu = await cpu()
  const started = performance.now()
  let sent = 0
  try {
    for (const checkpoint of checkpoints) {
      const latencies: number[] = []
      let stretchFailures = 0
      const before = await cpu()
      const stretchStarted = performance.now()
      for (; sent < checkpoint; sent++) {
        const t = performance.now()
        const status = await post(agent, url, path, bodies[sent])
        latencies.push(performance.now() - t)
        if (status !== 200) stretchFailures++
      }
      const seconds = (performance.now() - stretchStarted) / 1000
      stretches.push(summarize(latencies, stretchFailures, seconds, (await cpu()) - before))
      all.push(...latencies)
      failures += stretchFailures
    }
    const seconds = (performance.now() - started) / 1000
    return { stretches, whole: summarize(all, failures, seconds, (await cpu()) - startCpu) }
  } finally {
    agent.destroy()
  }
}

/** Sends `bodies.length` requests at `perSecond`, each on time whatever the earlier ones take. */
export async function atRate(
  url: string,
  path: string,
  bodies: string[],
  perSecond: number,
  cpu: CpuReader,
): Promise<PacedResult> {
  const agent = new Agent({ keepAlive: true, maxSockets: 64 })
  const latencies: number[] = []
  let failures = 0
  const before = await cpu()
  const started = performance.now()
  const pending: Promise<void>[] = []
  try {
    for (const [i, body] of bodies.entries()) {
      const due = started + (i * 1000) / perSecond
      const wait = due - performance.now()
      if (wait > 1) await new Promise((resolve) => setTimeout(resolve, wait))
      const t = performance.now()
      pending.push(
        post(agent, url, path, body).then((status) => {
          latencies.push(performance.now() - t)
          if (status !== 200) failures++
        }),
      )
    }
    await Promise.all(pending)
    const seconds = (performance.now() - started) / 1000
    return summarize(latencies, failures, seconds, (await cpu()) - before)
  } finally {
    agent.destroy()
  }
}

/** A port free a moment ago, for a server that is told its port rather than picking one. */
export async function freePort(): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  await new Promise((resolve) => server.close(resolve))
  return port
}

/**
 * Starts `command` with PORT set and times, from the moment the process is spawned, the first
 * answer to `GET path`: asked every 2 ms until one arrives. Latch listens only once its data file
 * is read, so the first answer is the first moment it can serve anything.
 */
export async function startToFirstAnswer(
  command: string,
  args: string[],
  env: Record<string, string>,
  path: string,
  cwd: string,
): Promise<number> {
  const port = await freePort()
  const started = performance.now()
  const child = spawn(command, args, { cwd, env: { ...env, PORT: String(port) }, stdio: 'ignore' })
  try {
    for (;;) {
      const status = await new Promise<number>((resolve) => {
        const req = request({ host: '127.0.0.1', port, path, agent: false }, (res) => {
          res.resume()
          res.on('end', () => resolve(res.statusCode ?? 0))
        })
        req.on('error', () => resolve(0))
        req.end()
      })
      if (status !== 0) return performance.now() - started
      if (child.exitCode !== null) throw new Error(`${command} ${args.join(' ')} exited ${child.exitCode}`)
      if (performance.now() - started > 30_000) throw new Error(`${command} did not answer within 30 s`)
      await new Promise((resolve) => setTimeout(resolve, 2))
    }
  } finally {
    await new Promise<void>((resolve) => {
      if (child.exitCode !== null) return resolve()
      child.once('exit', () => resolve())
      child.kill('SIGTERM')
    })
  }
}
