// MCP sign-in: the MCP SDK's own client and server pieces, signing in through Latch.
//
// - The MCP client (Client + StreamableHTTPClientTransport) knows only the MCP server's URL and
//   its Client ID Metadata Document URL, https://client.example/mcp-client.json. Everything else
//   comes from discovery: RFC 9728 protected resource metadata on the MCP server, then RFC 8414
//   metadata from Latch.
// - The client site `client.example` is an https server on 127.0.0.1 with a self-signed
//   certificate made here by openssl. Latch never fetches loopback addresses, so an injected
//   resolver answers a public-looking address and an injected https agent carries the TLS
//   connection to the local site; the certificate is still verified, against the test's CA.
// - The MCP server (McpServer on express) accepts a bearer token only if Latch's /introspect
//   says it is live and that its audience (`aud`, RFC 8707) is this server's resource URL.
// - The test plays the browser and the owner: Latch on a loopback issuer without PASSWORD_HASH
//   asks for no password, so approving is one form post.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { rm } from 'node:fs/promises'
import { createServer } from 'node:http'
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import { Agent as HttpsAgent, createServer as createHttpsServer } from 'node:https'
import type { RequestOptions as HttpsRequestOptions } from 'node:https'
import type { AddressInfo } from 'node:net'
import { connect as tlsConnect } from 'node:tls'
import type { TLSSocket } from 'node:tls'
import { Client } from '@modelcontextprotocol/sdk/client/index.js'
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js'
import { UnauthorizedError } from '@modelcontextprotocol/sdk/client/auth.js'
import type { OAuthClientProvider } from '@modelcontextprotocol/sdk/client/auth.js'
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js'
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js'
import { createMcpExpressApp } from '@modelcontextprotocol/sdk/server/express.js'
import { requireBearerAuth } from '@modelcontextprotocol/sdk/server/auth/middleware/bearerAuth.js'
import {
  getOAuthProtectedResourceMetadataUrl,
  mcpAuthMetadataRouter,
} from '@modelcontextprotocol/sdk/server/auth/router.js'
import { InvalidTokenError } from '@modelcontextprotocol/sdk/server/auth/errors.js'
import type { AuthInfo } from '@modelcontextprotocol/sdk/server/auth/types.js'
import type {
  OAuthClientInformationMixed,
  OAuthClientMetadata,
  OAuthMetadata,
  OAuthTokens,
} from '@modelcontextprotocol/sdk/shared/auth.js'
import type { FetchLike } from '@modelcontextprotocol/sdk/shared/transport.js'
import { LATEST_PROTOCOL_VERSION } from '@modelcontextprotocol/sdk/types.js'
import * as z from 'zod'
import { createHandler, loadConfig } from '../server.ts'
import { pageError, unescapeHtml } from './html.ts'
import { makeCertificate } from './tls.ts'
import type { ClientFetchOptions } from '../server.ts'

const CLIENT_ID = 'https://client.example/mcp-client.json'
const PUBLIC_ADDRESS = '93.184.215.14'
/** Where the MCP client says the browser should come back: a loopback port the document does not name. */
const REDIRECT_URL = 'http://127.0.0.1:33418/callback'
/** What the client publishes: loopback redirects without a port, which match any port (RFC 8252 §7.3). */
const CLIENT_METADATA: OAuthClientMetadata = {
  client_name: 'Latch MCP test client',
  redirect_uris: ['http://127.0.0.1/callback'],
  token_endpoint_auth_method: 'none',
  grant_types: ['authorization_code', 'refresh_token'],
  response_types: ['code'],
}
/** A client driven by hand, with no discovery: an IndieAuth loopback client_id (IndieAuth §3.3). */
const HAND_CLIENT_ID = 'http://127.0.0.1:8080/'
const HAND_REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const TEST_TIMEOUT = { timeout: 20_000 }

type Introspection = {
  active: boolean
  me?: string
  client_id?: string
  scope?: string
  aud?: string | string[]
  exp?: number
  iat?: number
}

// --- The client site, over TLS -------------------------------------------------------

const siteRequests: string[] = [] // `method host path` of every request the site received

function clientSite(req: IncomingMessage, res: ServerResponse): void {
  siteRequests.push(`${req.method} ${req.headers.host} ${req.url}`)
  if (req.url === '/mcp-client.json') {
    res.writeHead(200, { 'Content-Type': 'application/json' })
    return void res.end(JSON.stringify({ client_id: CLIENT_ID, ...CLIENT_METADATA }))
  }
  res.writeHead(404)
  res.end()
}

/**
 * Carries every connection to the local site, whatever address Latch checked. The TLS handshake
 * still names the host Latch asked for (SNI and the certificate check use `servername`) and
 * trusts only the agent's `ca`: a wrong certificate fails the fetch.
 */
class ClientSiteAgent extends HttpsAgent {
  sitePort = 0

  createConnection(options: HttpsRequestOptions): TLSSocket {
    return tlsConnect({
      host: '127.0.0.1',
      port: this.sitePort,
      servername: options.servername,
      ca: this.options.ca,
    })
  }
}

// --- Latch -------------------------------------------------------------------------------

type Latch = {
  issuer: string
  /** Latch's clock, which the test moves by hand. */
  now: () => number
  advance: (seconds: number) => void
  logs: string[]
  close: () => Promise<void>
}

async function startLatch(clientFetch: ClientFetchOptions): Promise<Latch> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const config = loadConfig({ PORT: '0', DATA_FILE: 'memory' }, [], {
    boundPort: (server.address() as AddressInfo).port,
  })
  let time = Date.UTC(2027, 0, 1)
  const logs: string[] = []
  server.on('request', createHandler({ config, now: () => time, log: (line) => logs.push(line), clientFetch }))
  return {
    issuer: config.issuer,
    now: () => time,
    advance: (seconds) => {
      time += seconds * 1000
    },
    logs,
    close: () => closeServer(server),
  }
}

function closeServer(server: Server): Promise<void> {
  server.closeAllConnections()
  return new Promise((resolve) => server.close(() => resolve()))
}

/** What /introspect says of a token to the resource server that names itself `resource`. */
async function introspect(latch: Latch, token: string, resource: string): Promise<Introspection> {
  const body = new URLSearchParams({ token, resource })
  const response = await fetch(`${latch.issuer}/introspect`, { method: 'POST', body })
  assert.equal(response.status, 200)
  return (await response.json()) as Introspection
}

// --- The MCP server ------------------------------------------------------------------------

type McpSite = {
  url: string
  /** The resource URL tokens must name as their audience. */
  resource: string
  /** Where its RFC 9728 protected resource metadata is. */
  metadataUrl: string
  /** What the bearer middleware handed the tool, one entry per call. */
  toolCalls: (AuthInfo | undefined)[]
  close: () => Promise<void>
}

type McpRequest = IncomingMessage & { body?: unknown; auth?: AuthInfo }

async function startMcpServer(latch: Latch): Promise<McpSite> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const origin = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  const resource = `${origin}/mcp`
  const metadataUrl = getOAuthProtectedResourceMetadataUrl(new URL(resource))
  const toolCalls: (AuthInfo | undefined)[] = []
  const asMetadata = await fetch(`${latch.issuer}/.well-known/oauth-authorization-server`)
  const oauthMetadata = (await asMetadata.json()) as OAuthMetadata

  /** Asks Latch about the token, and accepts it only for this server (RFC 8707 audience). */
  async function verifyAccessToken(token: string): Promise<AuthInfo> {
    const answer = await introspect(latch, token, resource)
    if (!answer.active) throw new InvalidTokenError('The access token is not active')
    const audiences = [answer.aud ?? []].flat()
    if (!audiences.includes(resource)) throw new InvalidTokenError(`The access token is not meant for ${resource}`)
    // The middleware compares expiresAt with the wall clock; Latch runs on the test's clock.
    const secondsLeft = (answer.exp ?? 0) - Math.floor(latch.now() / 1000)
    return {
      token,
      clientId: answer.client_id ?? '',
      scopes: (answer.scope ?? '').split(' ').filter((scope) => scope !== ''),
      expiresAt: Math.floor(Date.now() / 1000) + secondsLeft,
      resource: new URL(resource),
    }
  }

  function buildServer(): McpServer {
    const mcp = new McpServer({ name: 'latch-test-server', version: '1.0.0' })
    mcp.registerTool(
      'add',
      { description: 'Adds two numbers', inputSchema: { a: z.number(), b: z.number() } },
      ({ a, b }, extra) => {
        toolCalls.push(extra.authInfo)
        return { content: [{ type: 'text', text: String(a + b) }] }
      },
    )
    return mcp
  }

  const app = createMcpExpressApp({ host: '127.0.0.1' })
  app.use(mcpAuthMetadataRouter({ oauthMetadata, resourceServerUrl: new URL(resource), resourceName: 'Latch test' }))
  const bearer = requireBearerAuth({ verifier: { verifyAccessToken }, resourceMetadataUrl: metadataUrl })
  // Stateless: a server and a transport for each request, answering in JSON rather than SSE.
  app.post('/mcp', bearer, async (req: McpRequest, res: ServerResponse) => {
    const mcp = buildServer()
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: true })
    res.on('close', () => {
      void transport.close()
      void mcp.close()
    })
    await mcp.connect(transport)
    await transport.handleRequest(req, res, req.body)
  })
  app.all('/mcp', bearer, (_req: McpRequest, res: ServerResponse) => {
    res.writeHead(405, { Allow: 'POST' })
    res.end()
  })
  server.on('request', app)
  return { url: resource, resource, metadataUrl, toolCalls, close: () => closeServer(server) }
}

// --- The browser and the owner -------------------------------------------------------------

/**
 * Opens an authorization URL, approves the consent page as it stands (every offered scope box
 * that is checked, the preselected lifetime if there is a choice), and returns where the browser
 * is sent next.
 */
async function approveInBrowser(authorizationUrl: URL): Promise<URL> {
  const page = await fetch(authorizationUrl, { redirect: 'manual' })
  const html = await page.text()
  assert.equal(page.status, 200, `the consent page: ${pageError(html)}`)
  const action = /<form method="post" action="([^"]+)"/.exec(html)?.[1]
  const request = /name="request" value="([^"]+)"/.exec(html)?.[1]
  const csrf = /name="csrf" value="([^"]+)"/.exec(html)?.[1]
  const cookies = page.headers
    .getSetCookie()
    .map((line) => line.split(';')[0])
    .join('; ')
  assert.ok(action && request && csrf && cookies, 'the consent page carries a form and sets the csrf cookie')
  const form = new URLSearchParams({ request: unescapeHtml(request), csrf: unescapeHtml(csrf), decision: 'approve' })
  for (const box of html.matchAll(/<input type="checkbox" name="scope" value="([^"]*)" checked>/g))
    form.append('scope', unescapeHtml(box[1]))
  const lifetime = /<select name="lifetime">([\s\S]*?)<\/select>/.exec(html)?.[1]
  if (lifetime !== undefined) {
    const chosen =
      /<option value="([^"]+)" selected>/.exec(lifetime)?.[1] ?? /<option value="([^"]+)"/.exec(lifetime)?.[1]
    if (chosen !== undefined) form.set('lifetime', unescapeHtml(chosen))
  }
  const answer = await fetch(new URL(unescapeHtml(action), authorizationUrl), {
    method: 'POST',
    redirect: 'manual',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', Cookie: cookies },
    body: form,
  })
  assert.equal(answer.status, 303, `approving: ${pageError(await answer.text())}`)
  return new URL(answer.headers.get('location') ?? '')
}

// --- The MCP client ------------------------------------------------------------------------

/** The SDK's OAuthClientProvider, in memory, with the browser and the owner behind redirectToAuthorization. */
class TestClientProvider implements OAuthClientProvider {
  readonly clientMetadataUrl = CLIENT_ID
  readonly redirectUrl = REDIRECT_URL
  readonly clientMetadata = CLIENT_METADATA
  /** Every authorization URL the SDK sent the browser to. */
  readonly authorizationUrls: URL[] = []
  /** Every set of tokens the SDK saved, oldest first. */
  readonly savedTokens: OAuthTokens[] = []
  code: string | undefined
  private client: OAuthClientInformationMixed | undefined
  private verifier: string | undefined
  private lastState = ''
  private readonly issuer: string

  constructor(issuer: string) {
    this.issuer = issuer
  }

  state(): string {
    this.lastState = randomBytes(16).toString('base64url')
    return this.lastState
  }

  clientInformation(): OAuthClientInformationMixed | undefined {
    return this.client
  }

  saveClientInformation(information: OAuthClientInformationMixed): void {
    this.client = information
  }

  tokens(): OAuthTokens | undefined {
    return this.savedTokens.at(-1)
  }

  saveTokens(tokens: OAuthTokens): void {
    this.savedTokens.push(tokens)
  }

  saveCodeVerifier(verifier: string): void {
    this.verifier = verifier
  }

  codeVerifier(): string {
    if (this.verifier === undefined) throw new Error('No code verifier saved')
    return this.verifier
  }

  /** The browser goes to Latch, the owner approves, and the browser lands on the redirect URL. */
  async redirectToAuthorization(authorizationUrl: URL): Promise<void> {
    this.authorizationUrls.push(authorizationUrl)
    const location = await approveInBrowser(authorizationUrl)
    assert.equal(`${location.origin}${location.pathname}`, REDIRECT_URL, 'back on the port the client asked for')
    assert.equal(location.searchParams.get('error'), null, location.href)
    assert.equal(location.searchParams.get('state'), this.lastState)
    assert.equal(location.searchParams.get('iss'), this.issuer)
    this.code = location.searchParams.get('code') ?? undefined
    assert.ok(this.code, location.href)
  }
}

/** The token requests an MCP client made, as form bodies. */
type TokenRequests = URLSearchParams[]

function recordingFetch(latch: Latch, tokenRequests: TokenRequests): FetchLike {
  return (url, init) => {
    if (String(url) === `${latch.issuer}/token`) tokenRequests.push(new URLSearchParams(String(init?.body ?? '')))
    return fetch(url, init)
  }
}

/**
 * What an MCP application does, as in the SDK's simpleOAuthClient example: connect, which fails
 * with UnauthorizedError once the browser has been sent to sign in; finish the sign-in with the
 * code; connect again on a new transport.
 */
async function connectSignedIn(
  mcp: McpSite,
  provider: TestClientProvider,
  fetchFn: FetchLike,
): Promise<{ client: Client }> {
  const first = new StreamableHTTPClientTransport(new URL(mcp.url), { authProvider: provider, fetch: fetchFn })
  const refused = new Client({ name: 'latch-test-client', version: '1.0.0' })
  try {
    await refused.connect(first)
    assert.fail('the first connection succeeded without signing in')
  } catch (err) {
    if (!(err instanceof UnauthorizedError)) throw err // the real cause, not a wrapped one
  }
  assert.equal(provider.authorizationUrls.length, 1, 'the browser was sent to sign in once')
  assert.ok(provider.code)
  await first.finishAuth(provider.code)
  await first.close()
  const client = new Client({ name: 'latch-test-client', version: '1.0.0' })
  await client.connect(new StreamableHTTPClientTransport(new URL(mcp.url), { authProvider: provider, fetch: fetchFn }))
  return { client }
}

async function callAdd(client: Client, a: number, b: number): Promise<unknown> {
  const result = await client.callTool({ name: 'add', arguments: { a, b } })
  return result.content
}

/** Drives /auth and /token by hand for a token whose resource is `resource`, with no scope. */
async function tokenByHand(latch: Latch, resource: string): Promise<string> {
  const verifier = randomBytes(32).toString('base64url')
  const authorizationUrl = new URL(`${latch.issuer}/auth`)
  authorizationUrl.search = new URLSearchParams({
    response_type: 'code',
    client_id: HAND_CLIENT_ID,
    redirect_uri: HAND_REDIRECT_URI,
    state: 'hand',
    code_challenge: createHash('sha256').update(verifier).digest('base64url'),
    code_challenge_method: 'S256',
    resource,
  }).toString()
  const location = await approveInBrowser(authorizationUrl)
  const code = location.searchParams.get('code')
  assert.ok(code, location.href)
  const response = await fetch(`${latch.issuer}/token`, {
    method: 'POST',
    headers: { Accept: 'application/json' },
    body: new URLSearchParams({
      grant_type: 'authorization_code',
      code,
      client_id: HAND_CLIENT_ID,
      redirect_uri: HAND_REDIRECT_URI,
      code_verifier: verifier,
      resource,
    }),
  })
  const body = (await response.json()) as { access_token?: string }
  assert.equal(response.status, 200, JSON.stringify(body))
  assert.ok(body.access_token)
  return body.access_token
}

/** An MCP initialize request with a bearer token, as raw HTTP. */
function initializeWith(mcp: McpSite, token: string): Promise<Response> {
  return fetch(mcp.url, {
    method: 'POST',
    headers: {
      Authorization: `Bearer ${token}`,
      'Content-Type': 'application/json',
      Accept: 'application/json, text/event-stream',
    },
    body: JSON.stringify({
      jsonrpc: '2.0',
      id: 1,
      method: 'initialize',
      params: {
        protocolVersion: LATEST_PROTOCOL_VERSION,
        capabilities: {},
        clientInfo: { name: 'by-hand', version: '1.0.0' },
      },
    }),
  })
}

// --- Tests ------------------------------------------------------------------------------------

describe('MCP clients sign in through Latch (Client ID Metadata Documents, RFC 8707, RFC 9728)', () => {
  let certificate: { dir: string; key: Buffer; cert: Buffer }
  let site: Server
  let agent: ClientSiteAgent
  let latch: Latch
  let mcp: McpSite

  before(async () => {
    certificate = await makeCertificate('client.example')
    site = createHttpsServer({ key: certificate.key, cert: certificate.cert }, clientSite)
    await new Promise<void>((resolve) => site.listen(0, '127.0.0.1', resolve))
    agent = new ClientSiteAgent({ ca: certificate.cert })
    agent.sitePort = (site.address() as AddressInfo).port
    latch = await startLatch({
      lookup: async () => [{ address: PUBLIC_ADDRESS, family: 4 }],
      agent,
      timeoutMs: 2_000,
    })
    mcp = await startMcpServer(latch)
  })

  after(async () => {
    await mcp?.close()
    await latch?.close()
    agent?.destroy()
    if (site !== undefined) await closeServer(site)
    if (certificate !== undefined) await rm(certificate.dir, { recursive: true, force: true })
  })

  it('advertises Client ID Metadata Documents and public clients in its metadata', TEST_TIMEOUT, async () => {
    const response = await fetch(`${latch.issuer}/.well-known/oauth-authorization-server`)
    const metadata = (await response.json()) as Record<string, unknown>
    assert.equal(metadata.client_id_metadata_document_supported, true)
    assert.deepEqual(metadata.token_endpoint_auth_methods_supported, ['none'])
  })

  it('signs an MCP client in through its metadata document, and the tool call succeeds', TEST_TIMEOUT, async () => {
    const provider = new TestClientProvider(latch.issuer)
    const tokenRequests: TokenRequests = []
    const fetched = siteRequests.length
    const { client } = await connectSignedIn(mcp, provider, recordingFetch(latch, tokenRequests))
    try {
      // What the SDK asked Latch for: the document URL as client_id, no registration, the resource, no scope.
      const asked = provider.authorizationUrls[0].searchParams
      assert.equal(asked.get('client_id'), CLIENT_ID)
      assert.equal(asked.get('redirect_uri'), REDIRECT_URL)
      assert.equal(asked.get('resource'), mcp.resource)
      assert.equal(asked.get('code_challenge_method'), 'S256')
      assert.equal(asked.get('scope'), null)
      assert.ok(
        siteRequests.slice(fetched).includes('GET client.example /mcp-client.json'),
        `Latch fetched the document over TLS: ${siteRequests.slice(fetched).join(', ')}`,
      )
      assert.equal(tokenRequests.length, 1)
      assert.equal(tokenRequests[0].get('grant_type'), 'authorization_code')
      assert.equal(tokenRequests[0].get('client_id'), CLIENT_ID)
      assert.equal(tokenRequests[0].get('resource'), mcp.resource)

      assert.deepEqual(await callAdd(client, 2, 3), [{ type: 'text', text: '5' }])
      assert.equal(mcp.toolCalls.at(-1)?.clientId, CLIENT_ID)

      const tokens = provider.tokens()
      assert.ok(tokens)
      assert.equal(tokens.token_type.toLowerCase(), 'bearer')
      const introspection = await introspect(latch, tokens.access_token, mcp.resource)
      assert.equal(introspection.active, true)
      assert.equal(introspection.aud, mcp.resource) // a string: the token has one resource
      assert.equal(introspection.client_id, CLIENT_ID)
      assert.equal(introspection.me, `${latch.issuer}/`)
      assert.equal(introspection.scope ?? '', '') // no scope was asked for, and none granted
      assert.equal(typeof introspection.exp, 'number')
      assert.equal(introspection.iat, Math.floor(latch.now() / 1000))
    } finally {
      await client.close()
    }
  })

  it('refuses a token for another resource with 401 and a pointer to its resource metadata', TEST_TIMEOUT, async () => {
    const other = `${new URL(mcp.url).origin}/other`
    const foreign = await tokenByHand(latch, other)
    const foreignIntrospection = await introspect(latch, foreign, other)
    assert.equal(foreignIntrospection.active, true) // live at Latch, for the server it names
    assert.equal(foreignIntrospection.aud, other)
    assert.deepEqual(await introspect(latch, foreign, mcp.resource), { active: false }) // not for this one

    const refused = await initializeWith(mcp, foreign)
    assert.equal(refused.status, 401, await refused.text())
    const challenge = refused.headers.get('www-authenticate') ?? ''
    assert.match(challenge, /^Bearer /)
    assert.match(challenge, /error="invalid_token"/)
    assert.ok(challenge.includes(`resource_metadata="${mcp.metadataUrl}"`), challenge)

    // The metadata it points to names Latch, so a client knows where to sign in for this server.
    const document = (await (await fetch(mcp.metadataUrl)).json()) as Record<string, unknown>
    assert.equal(document.resource, mcp.resource)
    assert.deepEqual(document.authorization_servers, [latch.issuer])

    // The same steps for this server's resource give a token it accepts.
    const own = await tokenByHand(latch, mcp.resource)
    const accepted = await initializeWith(mcp, own)
    assert.equal(accepted.status, 200, await accepted.text())
  })

  it(
    'refreshes an expired access token with the same resource, and the tool call still succeeds',
    TEST_TIMEOUT,
    async () => {
      const provider = new TestClientProvider(latch.issuer)
      const tokenRequests: TokenRequests = []
      const { client } = await connectSignedIn(mcp, provider, recordingFetch(latch, tokenRequests))
      try {
        assert.deepEqual(await callAdd(client, 1, 1), [{ type: 'text', text: '2' }])
        const first = provider.tokens()
        assert.ok(first?.refresh_token, 'Latch issued a refresh token')
        assert.equal(typeof first.expires_in, 'number')

        latch.advance((first.expires_in ?? 0) + 1)
        assert.deepEqual(await introspect(latch, first.access_token, mcp.resource), { active: false })

        // The MCP server answers 401; the SDK refreshes on its own, with no new sign-in, and retries.
        assert.deepEqual(await callAdd(client, 20, 22), [{ type: 'text', text: '42' }])
        assert.equal(provider.authorizationUrls.length, 1, 'the owner was not asked again')
        const refresh = tokenRequests.at(-1)
        assert.equal(refresh?.get('grant_type'), 'refresh_token')
        assert.equal(refresh?.get('refresh_token'), first.refresh_token)
        assert.equal(refresh?.get('client_id'), CLIENT_ID)
        assert.equal(refresh?.get('resource'), mcp.resource)

        const second = provider.tokens()
        assert.ok(second)
        assert.notEqual(second.access_token, first.access_token)
        assert.notEqual(second.refresh_token, first.refresh_token) // rotated
        const introspection = await introspect(latch, second.access_token, mcp.resource)
        assert.equal(introspection.active, true)
        assert.equal(introspection.aud, mcp.resource)
        assert.equal(introspection.client_id, CLIENT_ID)
      } finally {
        await client.close()
      }
    },
  )
})
