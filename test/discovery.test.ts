// Client information discovery (IndieAuth §4.2) against real HTTP servers playing client sites.
// Names like `json.example` resolve, through an injected resolver, to public-looking addresses;
// an injected agent then carries every connection to the local site server, which answers by
// Host header. The address rules are checked on what the resolver returns, as in production.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { Agent, createServer, get as httpGet, globalAgent } from 'node:http'
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import { Socket, connect } from 'node:net'
import type { AddressInfo } from 'node:net'
import { lookup as dnsLookup } from 'node:dns'
import type { LookupAddress } from 'node:dns'
import { performance } from 'node:perf_hooks'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import * as latchModule from '../server.ts'
import { addressProblem, createHandler, hashPassword, loadConfig } from '../server.ts'
import { readClientPage, readLinkHeader, scanHtml } from '../server.ts'
import type { ClientFetchOptions } from '../server.ts'
import { until } from './harness.ts'

const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const PUBLIC_ADDRESS = '93.184.215.14'
/** For the Latches behind a proxy: without a password, a request a proxy forwards is refused. */
const PASSWORD_HASH = await hashPassword('correct horse battery', { ln: 10, r: 8, p: 1 })
const PNG = Buffer.from(
  'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==',
  'base64',
)

// --- The client sites ------------------------------------------------------------------

const requests: string[] = [] // `host path` of every request the sites received
let logoDown = false // flakylogo.example's logo answers 503 while set
/** What keepalive.example saw of its last request: its Connection header, and when its connection closed. */
const keptAlive: { connection?: string; closed?: Promise<unknown> } = {}

function sendJson(res: ServerResponse, body: unknown, headers: Record<string, string> = {}): void {
  res.writeHead(200, { 'Content-Type': 'application/json', ...headers })
  res.end(JSON.stringify(body))
}

function sendHtml(res: ServerResponse, html: string, headers: Record<string, string> = {}): void {
  res.writeHead(200, { 'Content-Type': 'text/html; charset=utf-8', ...headers })
  res.end(html)
}

/**
 * Sites that hold their answers until the test releases them: `shared.example` and
 * `heldN.example`. `open` counts their requests not answered yet, `most` the largest `open` seen.
 */
const held = { parked: [] as (() => void)[], released: false, open: 0, most: 0 }

function holdAnswers(): void {
  held.released = false
  held.most = held.open
}

function releaseHeld(): void {
  held.released = true
  for (const answer of held.parked.splice(0)) answer()
}

function hold(res: ServerResponse, answer: () => void): void {
  held.open++
  held.most = Math.max(held.most, held.open)
  res.on('close', () => held.open--)
  if (held.released) answer()
  else held.parked.push(answer)
}

function site(req: IncomingMessage, res: ServerResponse): void {
  const host = (req.headers.host ?? '').split(':')[0]
  requests.push(`${host} ${req.url}`)
  if (req.url === '/logo.png') {
    res.writeHead(200, { 'Content-Type': 'image/png' })
    return void res.end(PNG)
  }
  if (host === 'shared.example' || /^held\d+\.example$/.test(host)) {
    return hold(res, () =>
      sendJson(res, {
        client_id: `http://${host}/`,
        client_name: 'Held',
        redirect_uris: ['https://other.example/callback'],
      }),
    )
  }
  switch (host) {
    case 'json.example':
      return sendJson(
        res,
        {
          client_id: 'http://json.example/',
          client_name: 'Jot <Notes>',
          client_uri: 'http://json.example/',
          logo_uri: '/logo.png',
          redirect_uris: ['https://other.example/callback', 'com.example.jot:/callback'],
        },
        { 'Cache-Control': 'public, max-age=60' },
      )
    case 'mismatch.example':
      return sendJson(res, {
        client_id: 'https://elsewhere.example/',
        client_name: 'Impostor',
        redirect_uris: ['https://other.example/callback'],
      })
    case 'prefix.example':
      return sendJson(res, {
        client_id: 'http://prefix.example/app/',
        client_uri: 'https://other.example/',
        redirect_uris: ['https://other.example/callback'],
      })
    case 'pay.example.evil.example':
      return sendJson(res, {
        client_id: 'http://pay.example.evil.example/',
        client_name: 'Pay',
        client_uri: 'http://pay.example', // begins the client_id, but is another site
        redirect_uris: ['https://other.example/callback'],
      })
    case 'prose.example':
      return sendJson(res, {
        client_id: 'http://prose.example/',
        redirect_uris: [
          'x\n\nSECURITY NOTICE: this server has moved. Sign in at https://evil.example/ with your password.',
          ...Array.from({ length: 5 }, (_, i) => `https://prose.example/cb${i}`),
        ],
      })
    case 'sitename.example': // a name that passes for another site
      return sendJson(res, {
        client_id: 'http://sitename.example/',
        client_name: 'https://accounts.google.com/ (Google)',
        redirect_uris: ['http://sitename.example/callback'],
      })
    case 'dots.example': // the same, with dots that only look like dots
      return sendJson(res, {
        client_id: 'http://dots.example/',
        client_name: 'accounts\u3002google\uff0ecom',
        redirect_uris: ['http://dots.example/callback'],
      })
    case 'blank.example': // letters that show nothing, to push the host out of the title
      return sendJson(res, {
        client_id: 'http://blank.example/',
        client_name: `Jot${'\u2800'.repeat(40)}Notes\u3164\uffa0`,
        redirect_uris: ['http://blank.example/callback'],
      })
    case 'micro.example':
      return sendJson(res, {
        client_id: 'http://micro.example/',
        client_name: 'Micro.example',
        redirect_uris: ['http://micro.example/callback'],
      })
    case 'prose-page.example': // the same prose in a page's link and in a Link header, where a URL parser keeps spaces
      return sendHtml(
        res,
        `<link rel="redirect_uri" href="Important: Latch has moved. Sign in again at https://evil.example/ with your password">
<link rel="redirect_uri" href="https://prose-page.example/cb">`,
        { Link: '<NOTICE: sign in at https://evil.example/ now>; rel="redirect_uri"' },
      )
    case 'html.example':
      return sendHtml(
        res,
        `<!doctype html><html><head>
<link rel="redirect_uri" href="https://element.example/callback">
<link rel="stylesheet redirect_uri" href="https://app.html.example/second">
</head><body>
<div class="h-app"><img class="u-logo" src="/logo.png" alt=""><a class="u-url p-name" href="/">Quill &amp; Ink</a></div>
<!-- <link rel="redirect_uri" href="https://commented.example/"> -->
</body></html>`,
        { Link: '<https://header.example/callback>; rel="redirect_uri", <http://html.example/ignored>; rel="me"' },
      )
    case 'latin1.example': // the name in ISO-8859-1, named by the Content-Type
      res.writeHead(200, { 'Content-Type': 'text/html; charset=ISO-8859-1' })
      return void res.end(
        Buffer.from('<div class="h-app"><span class="p-name">Caf\u00e9 M\u00fcller</span></div>', 'latin1'),
      )
    case 'cp1252.example': // in windows-1252, named by a <meta> after another
      res.writeHead(200, { 'Content-Type': 'text/html' })
      return void res.end(
        Buffer.concat([
          Buffer.from('<meta name="viewport" content="width=device-width"><meta charset="windows-1252">'),
          Buffer.from('<div class="h-app"><span class="p-name">'),
          Buffer.from('Cr\u00e8me Br\u00fbl\u00e9e', 'latin1'), // what windows-1252 and Latin-1 share
          Buffer.from([0x20, 0x93, 0x80, 0x35, 0x94]), // and what only windows-1252 has: “€5”
          Buffer.from('</span></div>'),
        ]),
      )
    case 'charsets.example': {
      // what a browser makes of a <meta> in a comment, one naming UTF-16, and a charset in a quoted parameter
      const [contentType, page] = {
        '/commented': ['text/html', '<!-- <meta charset="windows-1251"> --><meta charset="utf-8">'],
        '/ucs-2': ['text/html', '<meta charset="ucs-2">'],
        '/quoted': ['text/html; profile="; charset=utf-16"', ''],
        '/named': ['text/html', '<meta name="charset=windows-1251" x=\'charset=koi8-r\'>'], // no charset attribute
        '/no-pragma': ['text/html', '<meta content="text/html; charset=windows-1251">'], // no http-equiv
      }[req.url ?? ''] ?? ['text/plain', '']
      res.writeHead(200, { 'Content-Type': contentType })
      return void res.end(`${page}<div class="h-app"><span class="p-name">Caf\u00e9 App</span></div>`)
    }
    case 'latin1s.example': {
      // the name in Latin-1, and the charset named as a browser would find it
      const [contentType, page] = {
        '/unknown-first': ['text/html; charset=nonesuch', '<meta charset="nonesuch"><meta charset="iso-8859-1">'],
        '/first-of-two': ['text/html; charset=iso-8859-1; charset=utf-8', ''],
        '/open-quote': ['text/html; charset="iso-8859-1', ''],
        '/short-comment': ['text/html', '<!--><meta/charset="iso-8859-1"><!--->'],
        '/spaced': ['text/html', '<meta charset=" iso-8859-1 ">'],
        '/pragma': ['text/html', '<meta http-equiv=Content-Type content="text/html;charset=iso-8859-1">'],
        // a label a browser does not know, a quote left open, a <meta> in a script: each passed over
        '/nbsp-label': ['text/html', '<meta charset="utf-8\u00a0"><meta charset="iso-8859-1">'],
        '/open-quote-content': [
          'text/html',
          `<meta http-equiv=content-type content="text/html; charset='utf-8"><meta charset=iso-8859-1>`,
        ],
        '/scripted': ['text/html', '<script>"<meta charset=utf-8>"</script><meta charset=iso-8859-1>'],
      }[req.url ?? ''] ?? ['text/plain', '']
      res.writeHead(200, { 'Content-Type': contentType })
      return void res.end(
        Buffer.from(`${page}<div class="h-app"><span class="p-name">Caf\u00e9 App</span></div>`, 'latin1'),
      )
    }
    case 'redirecting.example':
      res.writeHead(302, { Location: 'http://json.example/' })
      return void res.end()
    case 'big.example':
      return sendHtml(res, `<div class="h-app">${'x'.repeat(1024 * 1024)}</div>`)
    case 'slow.example':
      return // never answers
    case 'badlogo.example':
      if (req.url === '/not-an-image') return sendHtml(res, '<p>not a logo</p>')
      return sendJson(res, {
        client_id: 'http://badlogo.example/',
        client_name: 'Bad Logo',
        logo_uri: '/not-an-image',
        redirect_uris: ['https://other.example/callback'],
      })
    case 'biglogo.example':
    case 'fulllogo.example': // a logo of 64 KiB and one byte, and one of 64 KiB exactly
      if (req.url === '/huge.png') {
        res.writeHead(200, { 'Content-Type': 'image/png' })
        return void res.end(Buffer.alloc(64 * 1024 + (host === 'biglogo.example' ? 1 : 0)))
      }
      return sendJson(res, {
        client_id: `http://${host}/`,
        client_name: host === 'biglogo.example' ? 'Big Logo' : 'Full Logo',
        logo_uri: '/huge.png',
        redirect_uris: ['https://other.example/callback'],
      })
    case 'slowlogo.example': // a page that takes 0.7 s, and a logo that never comes
      if (req.url === '/stuck.png') return
      return void setTimeout(
        () =>
          sendJson(res, {
            client_id: 'http://slowlogo.example/',
            client_name: 'Slow Logo',
            logo_uri: '/stuck.png',
            redirect_uris: ['https://other.example/callback'],
          }),
        700,
      )
    case 'flakylogo.example':
      if (req.url === '/flaky.png') {
        res.writeHead(logoDown ? 503 : 200, { 'Content-Type': 'image/png' })
        return void res.end(logoDown ? undefined : PNG)
      }
      return sendJson(
        res,
        {
          client_id: 'http://flakylogo.example/',
          client_name: 'Flaky Logo',
          logo_uri: '/flaky.png',
          redirect_uris: ['https://other.example/callback'],
        },
        { 'Cache-Control': 'max-age=86400' },
      )
    case 'failing.example':
      res.writeHead(500)
      return void res.end()
    // answers node:http does not hand over as a response: they are written on the socket itself
    case 'switching.example':
      return void req.socket.write(
        'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n',
      )
    case 'interim.example':
      return pour(req.socket, '', 'HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n')
    case 'framing.example': // one byte of body per chunk, behind 15,000 bytes of chunk extension
      return pour(
        req.socket,
        'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n',
        `1;${'x'.repeat(15_000)}\r\na\r\n`,
      )
    case 'keepalive.example': {
      // a site that keeps the connection whatever it is asked, and sends a byte now and then
      keptAlive.connection = req.headers.connection
      keptAlive.closed = new Promise((resolve) => req.socket.on('close', resolve))
      const body = JSON.stringify({
        client_id: 'http://keepalive.example/',
        client_name: 'Kept Alive',
        redirect_uris: ['https://other.example/callback'],
      })
      const head = `HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\nConnection: keep-alive`
      req.socket.write(`${head}\r\n\r\n${body}`)
      const trickle = setInterval(() => req.socket.write('\r\n'), 100)
      return void req.socket.on('close', () => clearInterval(trickle))
    }
    case 'lan.example':
      return sendJson(res, {
        client_id: 'http://lan.example/',
        client_name: 'On the LAN',
        redirect_uris: ['https://other.example/callback'],
      })
    case 'bidi.example':
      return sendJson(res, {
        client_id: 'http://bidi.example/',
        client_name: '\u202eAcme\u202c \u2066Notes\u2069\u200b\u200e\u200f\u0007App',
        redirect_uris: ['https://other.example/callback'],
      })
    default:
      res.writeHead(404)
      res.end()
  }
}

/** Writes `head`, then `piece` again and again for as long as the peer reads. */
function pour(socket: Socket, head: string, piece: string): void {
  const more = () => {
    while (!socket.destroyed && socket.write(piece));
    if (!socket.destroyed) socket.once('drain', more)
  }
  socket.write(head)
  more()
}

let sites: Server
let sitesPort = 0
const sockets = new Set<Socket>()

/** An agent that takes every connection to the local site server, whatever the address. */
class SitesAgent extends Agent {
  createConnection(): Socket {
    const socket = connect(sitesPort, '127.0.0.1')
    sockets.add(socket)
    return socket
  }
}

const ADDRESSES: Record<string, string> = {
  'lan.example': '10.1.2.3',
  'loop.example': '127.0.0.2',
  'metadata.example': '169.254.169.254',
  'mapped.example': '::ffff:127.0.0.1',
}

const clientFetch: ClientFetchOptions = {
  lookup: async (hostname) => {
    if (hostname === 'nowhere.example') throw Object.assign(new Error('not found'), { code: 'ENOTFOUND' })
    const address = ADDRESSES[hostname] ?? PUBLIC_ADDRESS
    return [{ address, family: address.includes(':') ? 6 : 4 }]
  },
  agent: new SitesAgent(),
  timeoutMs: 300,
}

before(async () => {
  sites = createServer(site)
  await new Promise<void>((resolve) => sites.listen(0, '127.0.0.1', resolve))
  sitesPort = (sites.address() as AddressInfo).port
})

after(async () => {
  for (const socket of sockets) socket.destroy()
  sites.closeAllConnections()
  await new Promise((resolve) => sites.close(resolve))
})

// --- Latch ---------------------------------------------------------------------------------

type Latch = {
  base: string
  logs: string[]
  received: () => number
  advance: (seconds: number) => void
  close: () => Promise<void>
}

async function startLatch(
  env: Record<string, string> = {},
  fetchOptions: ClientFetchOptions = clientFetch,
): Promise<Latch> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const config = loadConfig({ PORT: '0', DATA_FILE: 'memory', ...env }, [], {
    boundPort: (server.address() as AddressInfo).port,
  })
  let time = Date.UTC(2027, 0, 1)
  const logs: string[] = []
  let received = 0
  server.on(
    'request',
    createHandler({ config, now: () => time, log: (line) => logs.push(line), clientFetch: fetchOptions }),
  )
  server.on('request', () => received++) // after the handler, which runs up to its first wait
  return {
    base: config.issuer,
    logs,
    received: () => received,
    advance: (seconds) => {
      time += seconds * 1000
    },
    close: () => {
      server.closeAllConnections()
      return new Promise((resolve) => server.close(() => resolve()))
    },
  }
}

function authorize(latch: Latch, clientId: string, redirectUri: string, from?: string): Promise<Response> {
  const query = new URLSearchParams({
    client_id: clientId,
    redirect_uri: redirectUri,
    state: 's',
    code_challenge: CHALLENGE,
    scope: 'create',
  })
  const headers: Record<string, string> = from === undefined ? {} : { 'X-Forwarded-For': from }
  return fetch(`${latch.base}/auth?${query}`, { redirect: 'manual', headers })
}

/**
 * Asserts a refusal: a 400 page that says only that the app's information could not be fetched,
 * while the log says why.
 */
async function assertNotFetched(latch: Latch, response: Response, clientId: string, why: RegExp): Promise<void> {
  assert.equal(response.status, 400)
  const html = await response.text()
  assert.match(html, /information could not be fetched/)
  assert.doesNotMatch(html, why)
  const line = latch.logs.findLast((entry) => entry.includes(` discovery: ${clientId} `))
  assert.match(line ?? '', why)
}

function fetchesOf(host: string): number {
  return requests.filter((request) => request === `${host} /`).length
}

// --- Tests ------------------------------------------------------------------------------------

describe('Client discovery (IndieAuth §4.2)', () => {
  let latch: Latch
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('reads JSON metadata: a listed redirect_uri on another host, the name and an inlined logo', async () => {
    const response = await authorize(latch, 'http://json.example/', 'https://other.example/callback')
    const html = await response.text()
    assert.equal(response.status, 200, html)
    assert.match(
      html,
      /<strong><bdi>Jot &#60;Notes&#62;<\/bdi><\/strong> at <code><bdi>http:\/\/json\.example\/<\/bdi><\/code>/,
    )
    assert.ok(html.includes(`src="data:image/png;base64,${PNG.toString('base64')}"`))
    // the browser will go to another host than the app's: the page says so plainly
    assert.match(
      html,
      /class="warning">After you decide, your browser goes to <code><bdi>other\.example<\/bdi><\/code>, not to <code><bdi>json\.example<\/bdi><\/code>/,
    )
    assert.doesNotMatch(html, /src="http/) // the page loads nothing from elsewhere
  })

  it("heads the consent page with the app's own host too when its name may name another site", async () => {
    const heading = async (clientId: string) => {
      const html = await (await authorize(latch, clientId, `${clientId}callback`)).text()
      return [/<title>([^<]*)<\/title>/.exec(html)?.[1], /<h1>(.*)<\/h1>/.exec(html)?.[1]]
    }
    assert.deepEqual(await heading('http://sitename.example/'), [
      'Sign in to https://accounts.google.com/ (Google) (sitename.example)',
      'Sign in to <bdi>https://accounts.google.com/ (Google) (sitename.example)</bdi>',
    ])
    assert.deepEqual(await heading('http://dots.example/'), [
      'Sign in to accounts\u3002google\uff0ecom (dots.example)',
      'Sign in to <bdi>accounts\u3002google\uff0ecom (dots.example)</bdi>',
    ])
    assert.deepEqual(await heading('http://blank.example/'), [
      'Sign in to Jot Notes',
      'Sign in to <bdi>Jot Notes</bdi>',
    ])
    assert.deepEqual(await heading('http://micro.example/'), [
      'Sign in to Micro.example', // its own host for a name: said once
      'Sign in to <bdi>Micro.example</bdi>',
    ])
  })

  it('shows the logo it fetched beside the app on /apps, once the owner has approved', async () => {
    const consent = await authorize(latch, 'http://json.example/', 'https://other.example/callback')
    const html = await consent.text()
    const cookie = (consent.headers.get('set-cookie') ?? '').split(';')[0]
    const field = (name: string) => new RegExp(`name="${name}" value="([^"]+)"`).exec(html)?.[1] ?? ''
    const approved = await fetch(`${latch.base}/auth/consent`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/x-www-form-urlencoded', Cookie: cookie },
      body: new URLSearchParams({
        request: field('request'),
        csrf: field('csrf'),
        scope: 'create',
        decision: 'approve',
      }),
      redirect: 'manual',
    })
    assert.equal(approved.status, 303)
    const code = new URL(approved.headers.get('location') ?? '').searchParams.get('code') ?? ''
    const exchanged = await fetch(`${latch.base}/token`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/x-www-form-urlencoded' },
      body: new URLSearchParams({
        grant_type: 'authorization_code',
        code,
        client_id: 'http://json.example/',
        redirect_uri: 'https://other.example/callback',
        code_verifier: 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk', // RFC 7636 Appendix B
      }),
    })
    assert.equal(exchanged.status, 200)
    const apps = await (await fetch(`${latch.base}/apps`)).text()
    const logo = `<img class="logo" src="data:image/png;base64,${PNG.toString('base64')}" alt="" width="32" height="32">`
    assert.ok(apps.includes(`<h2>${logo} <bdi>Jot &#60;Notes&#62;</bdi></h2>`), apps)
  })

  it('accepts a custom-scheme redirect_uri listed in metadata, and redirects there with the code', async () => {
    const response = await authorize(latch, 'http://json.example/', 'com.example.jot:/callback')
    const html = await response.text()
    assert.equal(response.status, 200, html)
    // a custom scheme's URI is shown whole, as an app's: a "host" in it says nothing of where the code goes
    assert.ok(
      html.includes(
        '<p class="warning">After you decide, your browser opens <code><bdi>com.example.jot:/callback</bdi></code>, ' +
          'which an app on this device handles',
      ),
      html,
    )
    const request = /name="request" value="([^"]+)"/.exec(html)?.[1] ?? ''
    const csrf = /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? ''
    const approved = await fetch(`${latch.base}/auth/consent`, {
      method: 'POST',
      redirect: 'manual',
      headers: { 'Content-Type': 'application/x-www-form-urlencoded', Cookie: `latch_csrf=${csrf}` },
      body: new URLSearchParams({ request, csrf, scope: 'create', decision: 'approve' }),
    })
    assert.equal(approved.status, 303)
    assert.match(
      approved.headers.get('location') ?? '',
      /^com\.example\.jot:\/callback\?code=[A-Za-z0-9_-]{43}&state=s&iss=/,
    )
  })

  it('shows only the first three URLs of what a client publishes on a refusal, never its prose', async () => {
    const response = await authorize(latch, 'http://prose.example/', 'https://other.example/callback')
    assert.equal(response.status, 400)
    const html = await response.text()
    assert.doesNotMatch(html, /SECURITY NOTICE/)
    assert.ok(
      html.includes('https://prose.example/cb0 , https://prose.example/cb1 , https://prose.example/cb2 and 2 more'),
      html,
    )
  })

  it("shows no stranger's prose from a client page's links or its Link header either", async () => {
    const response = await authorize(latch, 'http://prose-page.example/', 'https://other.example/callback')
    assert.equal(response.status, 400)
    const html = await response.text()
    assert.doesNotMatch(html, /has moved|NOTICE:|evil\.example/)
    assert.ok(html.includes('https://prose-page.example/cb'), html)
  })

  it('matches redirect URIs exactly: a trailing slash, an added query or another case is refused', async () => {
    for (const redirectUri of [
      'https://other.example/callback/',
      'https://other.example/callback?x=1',
      'https://other.example/Callback',
    ]) {
      const response = await authorize(latch, 'http://json.example/', redirectUri)
      assert.equal(response.status, 400, redirectUri)
      assert.equal(response.headers.get('location'), null)
      const html = await response.text()
      assert.ok(
        html.includes('https://other.example/callback , com.example.jot:/callback'),
        'the page lists what the client publishes',
      )
    }
  })

  it('refuses metadata whose client_id is not the URL it came from', async () => {
    const response = await authorize(latch, 'http://mismatch.example/', 'https://other.example/callback')
    await assertNotFetched(latch, response, 'http://mismatch.example/', /another client_id/)
    const sameHost = await authorize(latch, 'http://mismatch.example/', 'http://mismatch.example/callback')
    const html = await sameHost.text()
    assert.equal(sameHost.status, 200) // a redirect on the client's own host needs no discovery
    assert.doesNotMatch(html, /Impostor/)
  })

  it('refuses metadata whose client_uri is not a prefix of client_id, or a prefix on another site', async () => {
    const response = await authorize(latch, 'http://prefix.example/app/', 'https://other.example/callback')
    await assertNotFetched(latch, response, 'http://prefix.example/app/', /client_uri is not a prefix/)
    const lookalike = 'http://pay.example.evil.example/'
    const borrowed = await authorize(latch, lookalike, 'https://other.example/callback')
    await assertNotFetched(latch, borrowed, lookalike, /client_uri is not a prefix/)
  })

  it('reads an HTML page: h-app name and logo, rel=redirect_uri in elements and in the Link header', async () => {
    for (const redirectUri of [
      'https://element.example/callback',
      'https://app.html.example/second',
      'https://header.example/callback',
    ]) {
      const response = await authorize(latch, 'http://html.example/', redirectUri)
      const html = await response.text()
      assert.equal(response.status, 200, `${redirectUri}: ${html}`)
      assert.match(html, /<strong><bdi>Quill &#38; Ink<\/bdi><\/strong>/)
      assert.match(html, /src="data:image\/png;base64,/)
    }
    assert.equal((await authorize(latch, 'http://html.example/', 'https://commented.example/')).status, 400)
    assert.equal((await authorize(latch, 'http://html.example/', 'http://html.example/ignored')).status, 200) // same host anyway
  })

  it('reads a page in the charset its Content-Type or a <meta> names, as a browser does', async () => {
    for (const [host, name] of [
      ['latin1.example/', 'Caf\u00e9 M\u00fcller'],
      ['cp1252.example/', 'Cr\u00e8me Br\u00fbl\u00e9e \u201c\u20ac5\u201d'],
      ['charsets.example/commented', 'Caf\u00e9 App'],
      ['charsets.example/ucs-2', 'Caf\u00e9 App'],
      ['charsets.example/quoted', 'Caf\u00e9 App'],
      ['charsets.example/named', 'Caf\u00e9 App'],
      ['charsets.example/no-pragma', 'Caf\u00e9 App'],
      ...[
        ...['unknown-first', 'first-of-two', 'open-quote', 'short-comment', 'spaced', 'pragma'],
        ...['nbsp-label', 'open-quote-content', 'scripted'],
      ].map((path) => [`latin1s.example/${path}`, 'Caf\u00e9 App']),
    ]) {
      const response = await authorize(latch, `http://${host}`, `http://${host.split('/')[0]}/callback`)
      const html = await response.text()
      assert.equal(response.status, 200, html)
      assert.ok(html.includes(`<strong><bdi>${name}</bdi></strong>`), html)
    }
  })

  it('inlines only images of at most 64 KiB as a logo, and still shows the name', async () => {
    for (const host of ['badlogo.example', 'biglogo.example']) {
      const response = await authorize(latch, `http://${host}/`, 'https://other.example/callback')
      const html = await response.text()
      assert.equal(response.status, 200, html)
      assert.match(html, /<strong><bdi>(Bad|Big) Logo<\/bdi><\/strong>/)
      assert.doesNotMatch(html, /<img/)
    }
    const full = await authorize(latch, 'http://fulllogo.example/', 'https://other.example/callback')
    assert.match(await full.text(), /<img class="logo" src="data:image\/png;base64,/)
  })

  it('keeps a page whose logo could not be fetched for 30 seconds only, not for its own day', async () => {
    const flaky = () => authorize(latch, 'http://flakylogo.example/', 'https://other.example/callback')
    logoDown = true
    try {
      const first = await flaky()
      assert.equal(first.status, 200)
      assert.doesNotMatch(await first.text(), /<img/)
      assert.equal(fetchesOf('flakylogo.example'), 1)
      logoDown = false
      await (await flaky()).arrayBuffer()
      assert.equal(fetchesOf('flakylogo.example'), 1) // still kept
      latch.advance(31)
      const later = await flaky()
      assert.ok((await later.text()).includes(`src="data:image/png;base64,${PNG.toString('base64')}"`))
      assert.equal(fetchesOf('flakylogo.example'), 2)
    } finally {
      logoDown = false
    }
  })

  it('gives a page and its logo one deadline: a slow page leaves its logo what is left of it', async () => {
    const patient = await startLatch({}, { ...clientFetch, timeoutMs: 1_000 })
    try {
      const started = performance.now()
      const response = await authorize(patient, 'http://slowlogo.example/', 'https://other.example/callback')
      const page = await response.text()
      const waited = performance.now() - started
      assert.equal(response.status, 200)
      assert.match(page, /Slow Logo/)
      assert.doesNotMatch(page, /<img/)
      // 0.7 of the deadline went to the page: with a deadline of its own, the logo would take 1.7 in all
      assert.ok(waited < 1_400, `the consent page waited ${Math.round(waited)} ms for a deadline of 1,000`)
    } finally {
      await patient.close()
    }
  })

  it('does not follow a redirect from the client page', async () => {
    const before = fetchesOf('json.example')
    const response = await authorize(latch, 'http://redirecting.example/', 'https://other.example/callback')
    await assertNotFetched(latch, response, 'http://redirecting.example/', /answered 302/)
    assert.equal(fetchesOf('json.example'), before)
  })

  it("gives a lookup's place back when an app's resolver throws instead of rejecting", async () => {
    const lookup: ClientFetchOptions['lookup'] = (hostname) => {
      if (hostname.startsWith('throws')) throw Object.assign(new Error('no such name'), { code: 'ENOTFOUND' })
      if (hostname === 'null.example') throw null
      if (hostname === 'undefined.example') return Promise.reject(undefined)
      return clientFetch.lookup!(hostname)
    }
    const throwing = await startLatch({}, { ...clientFetch, lookup })
    try {
      // more than the 8 lookups that may be under way at once in the process
      for (let i = 0; i < 10; i++) {
        const clientId = `http://throws${i}.example/`
        const response = await authorize(throwing, clientId, 'https://other.example/callback')
        await assertNotFetched(throwing, response, clientId, /its host name does not resolve \(ENOTFOUND\)/)
      }
      // what it throws or rejects with may not be an Error at all
      for (const clientId of ['http://null.example/', 'http://undefined.example/']) {
        const response = await authorize(throwing, clientId, 'https://other.example/callback')
        await assertNotFetched(throwing, response, clientId, /its host name does not resolve \(no reason given\)/)
      }
      const found = await authorize(throwing, 'http://json.example/', 'https://other.example/callback')
      assert.equal(found.status, 200, await found.text())
    } finally {
      await throwing.close()
    }
  })

  it('gives up on an oversized page and on a slow one', async () => {
    const big = await authorize(latch, 'http://big.example/', 'https://other.example/callback')
    await assertNotFetched(latch, big, 'http://big.example/', /larger than 256 KiB/)
    const slow = await authorize(latch, 'http://slow.example/', 'https://other.example/callback')
    await assertNotFetched(latch, slow, 'http://slow.example/', /did not answer within 300 ms/)
    // out of time, which a stranger who keeps the lookups busy can bring about: no same-host pass
    // now, nor for 30 seconds from a failure remembered
    for (let i = 0; i < 2; i++) {
      const sameHost = await authorize(latch, 'http://slow.example/', 'http://slow.example/callback')
      await assertNotFetched(latch, sameHost, 'http://slow.example/', /did not answer within 300 ms/)
    }
  })

  it('gives up on a page that answers 101, which node:http drops without a word', { timeout: 10_000 }, async () => {
    const response = await authorize(latch, 'http://switching.example/', 'https://other.example/callback')
    await assertNotFetched(latch, response, 'http://switching.example/', /answered 101/)
  })

  it('gives up on interim answers without end, and on chunk framing without body, before the deadline', async () => {
    const interim = await authorize(latch, 'http://interim.example/', 'https://other.example/callback')
    await assertNotFetched(latch, interim, 'http://interim.example/', /more than 4 interim \(1xx\) answers/)
    const framing = await authorize(latch, 'http://framing.example/', 'https://other.example/callback')
    await assertNotFetched(latch, framing, 'http://framing.example/', /more than 352 KiB, counting its HTTP framing/)
  })

  it(
    'closes its connection to a client site after each fetch, even when its agent keeps connections alive',
    { timeout: 10_000 },
    async () => {
      const pooled = await startLatch({}, { ...clientFetch, agent: new SitesAgent({ keepAlive: true }) })
      try {
        const response = await authorize(pooled, 'http://keepalive.example/', 'https://other.example/callback')
        assert.equal(response.status, 200)
        assert.equal(keptAlive.connection, 'close')
        await keptAlive.closed
      } finally {
        await pooled.close()
      }
    },
  )

  it("takes no connection from the process's pool, which another request may have made to another address", async () => {
    // the embedding app's own request, through node's default agent, when the name meant this machine
    const host = `pooled.example:${sitesPort}`
    await new Promise((resolve, reject) => {
      const toHere = (_name: string, options: { all?: boolean }, callback: (...answer: unknown[]) => void) =>
        options.all ? callback(null, [{ address: '127.0.0.1', family: 4 }]) : callback(null, '127.0.0.1', 4)
      httpGet(`http://${host}/`, { agent: globalAgent, lookup: toHere as never }, (response) =>
        response.resume().on('end', resolve),
      ).on('error', reject)
    })
    const unpooled = await startLatch({}, { lookup: clientFetch.lookup, timeoutMs: 300 }) // no agent of its own
    try {
      const before = requests.length
      const response = await authorize(unpooled, `http://${host}/`, 'https://other.example/callback')
      assert.equal(response.status, 400)
      assert.equal(requests.length, before, 'the pooled connection to this machine was used')
    } finally {
      await unpooled.close()
      globalAgent.destroy()
    }
  })

  it('never fetches a loopback client_id, by address or by what its name resolves to', async () => {
    const count = requests.length
    assert.equal((await authorize(latch, 'http://127.0.0.1:8080/', 'http://other.example/callback')).status, 400)
    assert.equal((await authorize(latch, 'http://[::1]:8080/', 'http://other.example/callback')).status, 400)
    for (const host of ['loop.example', 'mapped.example', 'metadata.example']) {
      const response = await authorize(latch, `http://${host}/`, 'https://other.example/callback')
      await assertNotFetched(latch, response, `http://${host}/`, /loopback, link-local or special-use/)
    }
    assert.equal(requests.length, count)
  })

  it('connects to the address it checked, never to a second answer for the name (DNS rebinding)', async () => {
    // An agent that connects where the request's own lookup says, as node:net does: the site
    // server stands for the checked public address. Without a lookup of its own, the request
    // would ask the system's resolver again, which could answer 127.0.0.1 by then.
    const reached: string[] = []
    class ResolvingAgent extends Agent {
      createConnection(options: { host?: string; lookup?: typeof dnsLookup }): Socket {
        const socket = new Socket()
        const lookup = options.lookup ?? dnsLookup
        lookup(options.host ?? '', { all: false }, (err: Error | null, address: unknown) => {
          if (err) return socket.destroy(err)
          reached.push(String(address))
          if (address === PUBLIC_ADDRESS) socket.connect(sitesPort, '127.0.0.1')
          else socket.destroy(new Error(`connected to ${String(address)}`))
        })
        sockets.add(socket)
        return socket
      }
    }
    const pinned = await startLatch({}, { ...clientFetch, agent: new ResolvingAgent() })
    try {
      const response = await authorize(pinned, 'http://json.example/', 'https://other.example/callback')
      assert.equal(response.status, 200, await response.text())
      assert.ok(reached.length > 0 && reached.every((address) => address === PUBLIC_ADDRESS), reached.join()) // page and logo
    } finally {
      await pinned.close()
    }
  })

  it('never fetches a private address unless CLIENT_FETCH_PRIVATE=allow', async () => {
    const refused = await authorize(latch, 'http://lan.example/', 'https://other.example/callback')
    await assertNotFetched(latch, refused, 'http://lan.example/', /10\.1\.2\.3, a private address/)
    assert.equal(fetchesOf('lan.example'), 0)
    const lan = await startLatch({ CLIENT_FETCH_PRIVATE: 'allow' })
    const allowed = await authorize(lan, 'http://lan.example/', 'https://other.example/callback')
    assert.equal(allowed.status, 200)
    assert.match(await allowed.text(), /On the LAN/)
    await lan.close()
  })

  it('tells a stranger only that the app could not be fetched, and the log why (no addresses, no system errors)', async () => {
    const response = await authorize(latch, 'http://nowhere.example/', 'https://other.example/callback')
    await assertNotFetched(latch, response, 'http://nowhere.example/', /does not resolve \(ENOTFOUND\)/)
  })

  it('caches a result as long as Cache-Control allows, a minute when nothing says, and a failure 30 seconds', async () => {
    const cached = await startLatch()
    const before = fetchesOf('json.example')
    await authorize(cached, 'http://json.example/', 'https://other.example/callback')
    await authorize(cached, 'http://json.example/', 'https://other.example/callback')
    assert.equal(fetchesOf('json.example'), before + 1)
    cached.advance(61)
    await authorize(cached, 'http://json.example/', 'https://other.example/callback')
    assert.equal(fetchesOf('json.example'), before + 2)

    // a document without Cache-Control or Expires: a stranger asking for it again and again does
    // not have Latch fetch it as often (until its site answered 429, and no one could sign in)
    const silent = fetchesOf('prose.example')
    for (let i = 0; i < 3; i++) await authorize(cached, 'http://prose.example/', 'https://prose.example/cb0')
    assert.equal(fetchesOf('prose.example'), silent + 1)
    cached.advance(59)
    await authorize(cached, 'http://prose.example/', 'https://prose.example/cb0')
    assert.equal(fetchesOf('prose.example'), silent + 1)
    cached.advance(2)
    await authorize(cached, 'http://prose.example/', 'https://prose.example/cb0')
    assert.equal(fetchesOf('prose.example'), silent + 2)

    const failures = fetchesOf('failing.example')
    await authorize(cached, 'http://failing.example/', 'https://other.example/callback')
    // a 500 (or a 429), which a stranger asking again and again can bring about: remembered, but
    // the app may publish a metadata document, so no same-host pass
    const sameHost = await authorize(cached, 'http://failing.example/', 'http://failing.example/callback')
    assert.equal(sameHost.status, 400)
    assert.match(await sameHost.text(), /could not be fetched just now, try again in a moment/)
    assert.equal(fetchesOf('failing.example'), failures + 1)
    cached.advance(31)
    await authorize(cached, 'http://failing.example/', 'https://other.example/callback')
    assert.equal(fetchesOf('failing.example'), failures + 2)
    await cached.close()
  })

  it('shows a name without bidi overrides, isolates, invisible marks or controls, isolated in <bdi>', async () => {
    const response = await authorize(latch, 'http://bidi.example/', 'https://other.example/callback')
    const html = await response.text()
    assert.equal(response.status, 200, html)
    const hidden = /[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f\u200b-\u200f\u202a-\u202e\u2066-\u2069]/u.exec(html)
    assert.ok(hidden === null, `the page carries U+${hidden?.[0].codePointAt(0)?.toString(16).padStart(4, '0')}`)
    assert.match(
      html,
      /<strong><bdi>Acme Notes App<\/bdi><\/strong> at <code><bdi>http:\/\/bidi\.example\/<\/bdi><\/code>/,
    )
  })
})

describe('Discovery under load', () => {
  // Held answers would time out at 300 ms: these Latches wait as long as production does.
  const patient: ClientFetchOptions = { ...clientFetch, timeoutMs: 5_000 }

  it('shares one fetch among concurrent requests for the same client', async () => {
    holdAnswers()
    const latch = await startLatch({}, patient)
    try {
      const before = fetchesOf('shared.example')
      const answers = Array.from({ length: 20 }, async () => {
        const response = await authorize(latch, 'http://shared.example/', 'https://other.example/callback')
        await response.arrayBuffer()
        return response.status
      })
      assert.ok(
        await until(() => latch.received() === 20 && held.parked.length > 0),
        'all 20 requests arrived and the site was asked',
      )
      releaseHeld()
      assert.deepEqual(await Promise.all(answers), new Array(20).fill(200))
      assert.equal(fetchesOf('shared.example') - before, 1) // one fetch, shared
    } finally {
      releaseHeld()
      await latch.close()
    }
  })

  it('runs at most 8 fetches at once, queues 8 more, and answers the rest at once with a 400 and no fetch', async () => {
    holdAnswers()
    const latch = await startLatch({}, patient)
    const hosts = Array.from({ length: 30 }, (_, i) => `held${i}.example`)
    const statuses = new Map<string, number>()
    try {
      const answers = hosts.map(async (host) => {
        const response = await authorize(latch, `http://${host}/`, 'https://other.example/callback')
        await response.arrayBuffer()
        statuses.set(host, response.status)
      })
      const refused = () => [...statuses.values()].filter((status) => status === 400).length
      await until(() => held.most > 8 || (held.open === 8 && refused() >= 14))
      assert.ok(held.most <= 8, `the sites saw ${held.most} requests at once`)
      assert.equal(held.open, 8)
      assert.ok(refused() >= 14, `${refused()} of 30 were refused before any fetch ended`)
      assert.equal(statuses.size, refused()) // none was answered otherwise
      releaseHeld()
      await Promise.all(answers)
      assert.ok(held.most <= 8, `the sites saw ${held.most} requests at once`)
      for (const host of hosts) {
        const status = statuses.get(host)
        assert.ok(status === 200 || status === 400, `${host}: ${status}`)
        assert.equal(fetchesOf(host), status === 200 ? 1 : 0, host)
      }
      assert.equal([...statuses.values()].filter((status) => status === 200).length, 16)
    } finally {
      releaseHeld()
      await latch.close()
    }
  })
})

describe('Discovery for one address', () => {
  it('runs at most 2 lookups for one address at once, and refuses its third at once while others still get theirs', async () => {
    holdAnswers()
    // behind a proxy on this machine, as docs/deploy.md runs it: each client's address is its own
    const latch = await startLatch({ TRUST_PROXY: '127.0.0.1', PASSWORD_HASH }, { ...clientFetch, timeoutMs: 5_000 })
    const stranger = '198.51.100.7'
    try {
      const pending = ['held101', 'held102'].map((name) =>
        authorize(latch, `http://${name}.example/`, 'https://other.example/callback', stranger),
      )
      await until(() => fetchesOf('held101.example') + fetchesOf('held102.example') === 2)
      const third = await authorize(latch, 'http://held103.example/', 'https://other.example/callback', stranger)
      await assertNotFetched(latch, third, 'http://held103.example/', /198\.51\.100\.7 has 2 apps being looked up/)
      assert.equal(fetchesOf('held103.example'), 0)
      // nor on the app's own host: its document, unread, may list fewer (a metadata document's, exactly)
      const sameHost = await authorize(latch, 'http://held103.example/', 'http://held103.example/callback', stranger)
      await assertNotFetched(latch, sameHost, 'http://held103.example/', /198\.51\.100\.7 has 2 apps being looked up/)
      assert.equal(fetchesOf('held103.example'), 0)
      const someoneElse = authorize(latch, 'http://held104.example/', 'https://other.example/callback', '203.0.113.9')
      await until(() => fetchesOf('held104.example') === 1)
      releaseHeld()
      assert.deepEqual(
        await Promise.all([...pending, someoneElse].map(async (answer) => (await answer).status)),
        [200, 200, 200],
      )
      // its lookups done, the stranger may start more
      const later = await authorize(latch, 'http://held103.example/', 'https://other.example/callback', stranger)
      assert.equal(later.status, 200)
    } finally {
      releaseHeld()
      await latch.close()
    }
  })
})

describe('Discovery while host names do not resolve', () => {
  /**
   * A resolver that never answers names beginning `stuck`, until the test settles them: as
   * dns.lookup, which holds one of libuv's few threads until the system's resolver gives up.
   */
  function stuckResolver() {
    const stuck: (() => void)[] = []
    const lookup = (hostname: string) =>
      hostname.startsWith('stuck')
        ? new Promise<LookupAddress[]>((_resolve, reject) => stuck.push(() => reject(new Error('timed out'))))
        : (clientFetch.lookup ?? (() => Promise.resolve([])))(hostname)
    return { stuck, lookup }
  }

  it("counts one address's lookups until their host names settle, not only until the fetch gives up", async () => {
    const { stuck, lookup } = stuckResolver()
    const latch = await startLatch({ TRUST_PROXY: '127.0.0.1', PASSWORD_HASH }, { ...clientFetch, lookup })
    const stranger = '198.51.100.7'
    try {
      for (const i of [1, 2]) {
        const gaveUp = await authorize(latch, `http://stuck${i}.example/`, `http://stuck${i}.example/cb`, stranger)
        // at its deadline, its host name still being resolved: not checked, so not let through
        assert.equal(gaveUp.status, 400)
        assert.match(await gaveUp.text(), /could not be fetched just now, try again in a moment/)
      }
      assert.equal(stuck.length, 2)
      const third = await authorize(latch, 'http://stuck3.example/', 'https://other.example/callback', stranger)
      await assertNotFetched(latch, third, 'http://stuck3.example/', /198\.51\.100\.7 has 2 apps being looked up/)
      assert.equal(stuck.length, 2) // not even resolved
      for (const settle of stuck.splice(0)) settle()
      await new Promise((resolve) => setImmediate(resolve)) // the settled lookups count down
      const later = await authorize(latch, 'http://json.example/', 'https://other.example/callback', stranger)
      assert.equal(later.status, 200)
    } finally {
      for (const settle of stuck.splice(0)) settle()
      await latch.close()
    }
  })

  it('counts a lookup until it settles, past the fetch that gave up on it, and refuses a ninth without remembering', async () => {
    const { stuck, lookup } = stuckResolver()
    const latch = await startLatch({}, { ...clientFetch, lookup })
    try {
      const stalled = await Promise.all(
        Array.from({ length: 8 }, (_, i) =>
          authorize(latch, `http://stuck${i}.example/`, `http://stuck${i}.example/cb`),
        ),
      )
      assert.deepEqual(
        stalled.map((response) => response.status),
        new Array(8).fill(400), // each gave up at its deadline: its redirect_uri on its own host, but not checked
      )
      assert.equal(stuck.length, 8)
      const before = fetchesOf('json.example')
      await assertNotFetched(
        latch,
        await authorize(latch, 'http://json.example/', 'https://other.example/callback'),
        'http://json.example/',
        /too many host names are being resolved at once/,
      )
      assert.equal(fetchesOf('json.example'), before)
      for (const settle of stuck.splice(0)) settle() // each counts down as its rejection is handled, before the next request
      assert.equal((await authorize(latch, 'http://json.example/', 'https://other.example/callback')).status, 200) // not remembered
      assert.equal(fetchesOf('json.example'), before + 1)
    } finally {
      for (const settle of stuck.splice(0)) settle()
      await latch.close()
    }
  })
})

describe('Discovery parsers and address rules', () => {
  it('reads the first h-app, and falls back to its text for a name', () => {
    const page = readClientPage(
      '<div class="h-x-app">  My\n <b>App</b> <a class="u-url" href="/home">home</a></div><div class="h-app"><span class="p-name">Second</span></div>',
      'https://a.example/',
    )
    assert.equal(page.name, 'My App home')
    assert.equal(page.url, 'https://a.example/home')
    assert.deepEqual(page.redirectUris, [])
  })

  it('keeps a name apart from the page it was read from: a pending request holds the name, not 256 KiB', () => {
    setFlagsFromString('--expose-gc')
    const gc = runInNewContext('gc') as () => void
    const pageSize = 256 * 1024
    // a name of 13 characters or more, left as it is by the cleaning: V8 would keep it as a slice of the page
    const page = (i: number) => `<div class="h-app"><span class="p-name">NameWithoutSpaces${i}</span></div>`
    gc()
    const before = process.memoryUsage().heapUsed
    const names = Array.from({ length: 40 }, (_, i) =>
      readClientPage(`${page(i)}${'x'.repeat(pageSize)}`, 'https://a.example/'),
    ).map((document) => document.name)
    gc()
    const kept = process.memoryUsage().heapUsed - before
    assert.equal(names[39], 'NameWithoutSpaces39')
    assert.ok(kept < (40 * pageSize) / 10, `40 names kept ${kept} bytes`)
  })

  it("shows an h-app's u-url only on the client's own origin, and not past 2,048 characters", () => {
    const read = (href: string) =>
      readClientPage(
        `<div class="h-app"><a class="u-url p-name" href="${href}">App</a></div>`,
        'https://a.example/app/',
      ).url
    assert.equal(read('/'), 'https://a.example/')
    assert.equal(read('https://a.example/about'), 'https://a.example/about')
    assert.equal(read('https://bank.example/'), undefined)
    assert.equal(read('javascript:alert(1)'), undefined)
    assert.equal(read(`/${'a'.repeat(2048)}`), undefined)
  })

  it('stops at 10,000 tags and never leaves a tag unclosed past the end, however hostile the page', () => {
    assert.equal(scanHtml('<b>'.repeat(20_000)).length, 10_000)
    assert.deepEqual(
      scanHtml('<a href="x">ok</a><b title="never closed>').map((element) => element.name),
      ['a'],
    )
    assert.equal(readClientPage(`<div class="h-app">${'<span>'.repeat(300)}Name`, 'https://a.example/').name, 'Name')
  })

  it("finds a script's end tag in upper or lower case, after text that grows when lower-cased (İ)", () => {
    const page = readClientPage(
      `<title>${'İ'.repeat(70)}</title><SCRIPT>var x = 1</Script>` +
        '<link rel="redirect_uri" href="https://app.example/callback"><div class="h-app"><b class="p-name">Turk</b></div>',
      'https://a.example/',
    )
    assert.deepEqual(page.redirectUris, ['https://app.example/callback'])
    assert.equal(page.name, 'Turk')
  })

  it('keeps only the attributes discovery reads, so that a tag of hundreds costs little', () => {
    const [element] = scanHtml(`<a ${'data-x=1 '.repeat(300)}CLASS="h-app" rel=me href='/' src=x title="t">`)
    assert.deepEqual(element.attributes, { class: 'h-app', rel: 'me', href: '/', src: 'x' })
  })

  it('stops at 10,000 closing tags', () => {
    const names = (html: string) => scanHtml(html).map((element) => element.name)
    assert.deepEqual(names(`${'</x>'.repeat(9_999)}<a class="h-app">`), ['a'])
    assert.deepEqual(names(`${'</x>'.repeat(10_000)}<a class="h-app">`), [])
  })

  it('scans a page of deep nesting and stray closing tags in time linear in its size', () => {
    const size = 256 * 1024
    const nested = '<div>'.repeat(256)
    const crafted = nested + '</x>'.repeat((size - nested.length) / 4)
    const plain = '<p>a</p>'.repeat(size / 8) // as many tags, every one of them matched
    assert.equal(crafted.length, size)
    assert.equal(plain.length, size)
    const best = (html: string) => {
      let fastest = Infinity
      for (let run = 0; run < 5; run++) {
        const start = performance.now()
        scanHtml(html)
        fastest = Math.min(fastest, performance.now() - start)
      }
      return fastest
    }
    best(plain) // warm up
    const ratio = best(crafted) / best(plain)
    assert.ok(ratio < 5, `the crafted page took ${ratio.toFixed(1)} times as long as a plain one`)
  })

  it('never shows half a tag as a name, where the text it reads of an element ends inside one', () => {
    const page = readClientPage(
      `<div class="h-app p-name">${'<span class="xy">'.repeat(200)}Notes</div>`,
      'https://a.example/',
    )
    assert.equal(page.name, undefined) // the first 2,000 characters hold tags only
    const hearts = readClientPage(
      '<div class="h-app"><span class="p-name">I <3 Latch</span></div>',
      'https://a.example/',
    )
    assert.equal(hearts.name, 'I <3 Latch') // nothing was cut: a bare < is text
  })

  it('cleans a name to one line of plain text, at most 100 characters, never half a character', () => {
    assert.equal(latchModule.cleanName('\u202egnp.exe'), 'gnp.exe')
    assert.equal(latchModule.cleanName('  Two\n\tlines\u2028here '), 'Two lines here')
    assert.equal(latchModule.cleanName('\u2066\u200b\u200e\u200f\u2069'), undefined)
    assert.equal(latchModule.cleanName('مرحبا'), 'مرحبا') // right-to-left letters stay: only formatting goes
    assert.equal(latchModule.cleanName(`${'x'.repeat(99)}\u{1f600}`), 'x'.repeat(99))
  })

  it('resolves relative redirect URIs against the page and ignores other relations', () => {
    const page = readClientPage(
      "<link rel='redirect_uri' href='cb?x=1'><link rel=me href=/me><link rel=redirect_uri href=https://b.example/>",
      'https://a.example/app/',
    )
    assert.deepEqual(page.redirectUris, ['https://a.example/app/cb?x=1', 'https://b.example/'])
  })

  it('takes no redirect_uri link that a browser reads as a comment or as text', () => {
    const link = (path: string) => `<link rel=redirect_uri href=${path}>`
    const page = readClientPage(
      [
        `<!DOCTYPE html><! ${link('/bogus')} ><? ${link('/question')} ?></3 ${link('/slash')} >`,
        `<title>${link('/title')}</title><textarea>${link('/textarea')}</textarea>`,
        `<!-- x --!>${link('/after-bang')}<!-->${link('/after-short')}<!-- ${link('/commented')} -->`,
      ].join(''),
      'https://a.example/',
    )
    assert.deepEqual(page.redirectUris, ['https://a.example/after-bang', 'https://a.example/after-short'])
    const text = [
      `<!--!> ${link('/bang-inside')} --><title></titlex>${link('/title-prefix')}</title>`, // neither ends there
      `<xmp>${link('/xmp')}</xmp><noscript>${link('/noscript')}</noscript><iframe>${link('/iframe')}</iframe>`,
      `<link:x rel=redirect_uri href=/namespaced><link rel="x\u00a0redirect_uri" href=/nbsp>`, // not a link, not the rel
      `<lin\u212a rel=redirect_uri href=/kelvin><link rel=redirect_uri\u00a0href=/nbsp-between>`, // K is no k
      `<div a"b c='x">' ${link('/quote-in-name')} '><link =rel=redirect_uri href=/equals-first>`,
      `<link rel rel=redirect_uri href=/valueless-first><link rel="x&nbsp;redirect_uri" href=/nbsp-entity>`,
      `<template>${link('/template')}<!--</template>${link('/template-comment')}--></template>`,
      `<template><a title="</template>${link('/template-value')}"></a></template>`,
      `<link rel=redirect_uri href="https://a.example&sol;@evil.example/cb">`, // a name Latch does not know
      `${link('/last')}<plaintext>${link('/plaintext')}`,
    ]
    assert.deepEqual(readClientPage(text.join(''), 'https://a.example/').redirectUris, ['https://a.example/last'])
  })

  it('never shows half a tag where the 2,000 characters of a name end inside one', () => {
    const page = readClientPage(
      `<div class=h-app><span class=p-name>${'<i></i>'.repeat(285)}App</b></span></div>`,
      'https://a.example/',
    )
    assert.equal(page.name, 'App')
  })

  it('reads a name and a link as a browser shows them: entities, a > in a quoted value, a no-break space', () => {
    const page = readClientPage(
      '<div class="h-app"/><span class="p-name"><b title="x>Evil Corp">Caf&eacute; &mdash; &#147;Q&#148;</b> ' +
        '&AMP; &Amp; &#0;</span></div><link rel=redirect_uri href="&nbsp;https://evil.example/cb">',
      'https://a.example/',
    )
    assert.equal(page.name, 'Caf\u00e9 \u2014 \u201cQ\u201d & &Amp; \ufffd')
    assert.deepEqual(page.redirectUris, ['https://a.example/%C2%A0https://evil.example/cb']) // a path of its own
  })

  it('reads a name written in a <title> or a <textarea>, and passes over a comment in it, whatever it holds', () => {
    const titled = '<html class=h-app><head><title class=p-name>Foo App</title></head></html>'
    assert.equal(readClientPage(titled, 'https://a.example/').name, 'Foo App')
    const commented = '<div class=h-app><span class=p-name>Good<!-- a > b -->App</span></div>'
    assert.equal(readClientPage(commented, 'https://a.example/').name, 'Good App')
  })

  it('reads redirect_uri links from a Link header with several relations', () => {
    const header = '</a>; rel="redirect_uri me", <https://c.example/b>; title="x"; rel=redirect_uri, </c>; rel="next"'
    assert.deepEqual(readLinkHeader(header, 'redirect_uri', 'https://a.example/'), [
      'https://a.example/a',
      'https://c.example/b',
    ])
  })

  const addresses: [string, boolean, string | undefined][] = [
    ['93.184.215.14', false, undefined],
    ['2606:2800:21f:cb07:6820:80da:af6b:8b2c', false, undefined],
    ['127.0.0.1', true, 'loopback'],
    ['127.1.2.3', true, 'loopback'],
    ['::1', true, 'loopback'],
    ['::ffff:127.0.0.1', true, 'loopback'],
    ['0.0.0.0', true, 'loopback'],
    ['169.254.169.254', true, 'link-local'],
    ['fe80::1', true, 'link-local'],
    ['224.0.0.1', true, 'special-use'],
    ['10.0.0.1', false, 'private'],
    ['172.20.1.1', false, 'private'],
    ['192.168.1.1', false, 'private'],
    ['100.100.1.1', false, 'private'],
    ['fd12::1', false, 'private'],
    ['::127.0.0.1', true, 'loopback'],
    ['::a9fe:a9fe', true, 'link-local'],
    ['::ffff:7f00:1', true, 'loopback'],
    ['::ffff:0:7f00:1', true, 'loopback'],
    ['64:ff9b:1::1', true, 'special-use'],
    ['fec0::1', true, 'special-use'],
    ['3fff::1', true, 'special-use'],
    ['5f00::1', true, 'special-use'],
    ['100:0:0:1::1', true, 'special-use'],
    ['240.0.0.1', true, 'special-use'],
    ['255.255.255.255', true, 'special-use'],
    ['192.88.99.1', true, 'special-use'],
    ['::ffff:10.0.0.1', false, 'private'],
    ['64:ff9b::a00:1', false, 'private'],
    ['64:ff9b::808:808', false, undefined],
    ['::ffff:8.8.8.8', false, undefined],
    ['2606:4700::1', false, undefined],
  ]
  for (const [address, evenWhenAllowed, kind] of addresses) {
    it(`${kind === undefined ? 'allows' : 'refuses'} ${address}${kind === 'private' ? ' unless private addresses are allowed' : ''}`, () => {
      assert.equal(addressProblem(address, false) === undefined, kind === undefined)
      assert.equal(addressProblem(address, true) === undefined, !evenWhenAllowed)
    })
  }
})
