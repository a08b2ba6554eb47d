// A real peer: node-oidc-provider (npm `oidc-provider` 9.13, panva's certified OpenID Connect and OAuth 2.0 server,
// on Koa) answering the same token exchange, introspection and revocation as Latch. bench/run.ts starts it as it
// starts the bare server: `node --import tsx --import <bench/probe.ts URL> bench/peer.ts`, output to a file, with an
// IPC channel. It listens on 127.0.0.1, port 0, and prints
// `listening <port> token=/token introspection=/token/introspection revocation=/token/revocation`.
// On Node 20 the provider prints one warning as it loads ("Unsupported runtime. Use Node.js v22.x LTS"), and works.
//
// Settings: issuer http://127.0.0.1:<port>; features introspection and revocation on, resourceIndicators off (so
// access tokens are opaque, never JWTs), devInteractions off; response type code only; PKCE as the provider does it
// (S256 only, required of public clients); scopes `profile create` (`openid` is not needed: without it the provider
// issues no ID token). One public client: client_id `http://127.0.0.1:8080/` (a URL is accepted as it is), redirect
// URI http://127.0.0.1:8080/callback, token_endpoint_auth_method none, grant type authorization_code. Lifetimes are
// Latch's defaults: codes 300 s, access tokens 7 days, and tokens do not end with the browser session
// (expiresWithSession false), as Latch's do not. Signing and cookie keys are made at start, and findAccount and the
// allowedPolicy functions are given (a client may introspect and revoke its own tokens): no development-only notices.
//
// Storage is the provider's own in-memory adapter (its MemoryAdapter class over its LRU) with room for STORE_ENTRIES
// entries instead of the default 1,000: with the default, only 250 of a batch of 9,000 minted codes still redeem.
// An entry nobody reads is dropped after STORE_ENTRIES to twice as many newer entries (a minted code or token adds 3
// with its grant, an exchange 1 more): mint the token to introspect just before it is used. Each code or token has
// its own grant, as after a sign-in.
//
// Requests, all POST application/x-www-form-urlencoded, all answered 200:
//   /token                 grant_type=authorization_code&code=CODE&client_id=http%3A%2F%2F127.0.0.1%3A8080%2F
//                          &redirect_uri=http%3A%2F%2F127.0.0.1%3A8080%2Fcallback&code_verifier=dBjftJeZ4CVP-mB92K27…
//   /token/introspection   token=TOKEN&client_id=http%3A%2F%2F127.0.0.1%3A8080%2F
//                          (without client_id: 400 "no client authentication mechanism provided"; a public client,
//                          auth method none, may introspect its own tokens)
//   /token/revocation      token=TOKEN&client_id=http%3A%2F%2F127.0.0.1%3A8080%2F (the same)
//
// IPC messages, besides bench/probe.ts's 'usage' (answered with process.send, minted through the provider's models,
// not over HTTP):
//   { kind: 'codes', count }  → { codes: string[] }   fresh codes for the client, its redirect URI, the challenge of
//                                                       RFC 7636 Appendix B (S256), scope `profile create`
//   { kind: 'tokens', count } → { tokens: string[] }  live opaque access tokens for the client, the same scope

import { generateKeyPairSync, randomBytes } from 'node:crypto'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import Provider from 'oidc-provider'
import type { Adapter, Configuration, JWK } from 'oidc-provider'

export type PeerRequest = { kind: 'codes'; count: number } | { kind: 'tokens'; count: number }
export type PeerAnswer = { codes: string[] } | { tokens: string[] }

const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const SCOPE = 'profile create'
const ACCOUNT_ID = 'https://example.com/'
const ROUTES = { token: '/token', introspection: '/token/introspection', revocation: '/token/revocation' }
/** The store keeps at least the last STORE_ENTRIES entries written or read, and at most twice as many. */
const STORE_ENTRIES = 200_000

// The provider's own adapter and LRU: internal modules, without types of their own.
type Store = object
const { default: MemoryAdapter } = (await import('oidc-provider/lib/adapters/memory_adapter.js' as string)) as {
  default: new (model: string, store: Store) => Adapter
}
const { default: LRU } = (await import('oidc-provider/lib/helpers/lru.js' as string)) as {
  default: new (options: { maxSize: number }) => Store
}
const store = new LRU({ maxSize: STORE_ENTRIES })

const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 })

const configuration: Configuration = {
  adapter: (model) => new MemoryAdapter(model, store),
  clients: [
    {
      client_id: CLIENT_ID,
      redirect_uris: [REDIRECT_URI],
      token_endpoint_auth_method: 'none',
      grant_types: ['authorization_code'],
      response_types: ['code'],
    },
  ],
  responseTypes: ['code'],
  scopes: ['profile', 'create'],
  features: {
    devInteractions: { enabled: false },
    resourceIndicators: { enabled: false },
    introspection: {
      enabled: true,
      // The provider's default, given so that it prints no notice: a public client sees only its own tokens.
      allowedPolicy: async (_ctx, client, token) =>
        client.clientAuthMethod !== 'none' || token.clientId === client.clientId,
    },
    revocation: { enabled: true, allowedPolicy: async (_ctx, client, token) => token.clientId === client.clientId },
  },
  routes: ROUTES,
  ttl: { AuthorizationCode: 300, AccessToken: 7 * 24 * 3600, Grant: 7 * 24 * 3600, Session: 14 * 24 * 3600 },
  expiresWithSession: () => false,
  findAccount: async (_ctx, sub) => ({ accountId: sub, claims: async () => ({ sub }) }),
  jwks: { keys: [{ ...(privateKey.export({ format: 'jwk' }) as JWK), alg: 'RS256', use: 'sig' }] },
  cookies: { keys: [randomBytes(32).toString('base64url')] },
}

// Listen first: the issuer names the port.
const server = createServer()
await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
const { port } = server.address() as AddressInfo
const provider = new Provider(`http://127.0.0.1:${port}`, configuration)
provider.on('server_error', (_ctx, error) => console.error('error:', error))
server.on('request', provider.callback())

const registered = await provider.Client.find(CLIENT_ID)
if (registered === undefined) throw new Error(`client ${CLIENT_ID} is not registered`)
const client = registered

/** A grant as the consent leaves it: this account, this client, the scope. */
async function mintGrant(): Promise<string> {
  const grant = new provider.Grant({ accountId: ACCOUNT_ID, clientId: CLIENT_ID })
  grant.addOIDCScope(SCOPE)
  return grant.save()
}

/** A code as the authorization endpoint saves it after consent. */
async function mintCode(): Promise<string> {
  return new provider.AuthorizationCode({
    client,
    accountId: ACCOUNT_ID,
    authTime: Math.floor(Date.now() / 1000),
    codeChallenge: CHALLENGE,
    codeChallengeMethod: 'S256',
    grantId: await mintGrant(),
    gty: 'authorization_code',
    redirectUri: REDIRECT_URI,
    scope: SCOPE,
  }).save()
}

/** An access token as the token endpoint saves it after an exchange. */
async function mintToken(): Promise<string> {
  return new provider.AccessToken({
    client,
    accountId: ACCOUNT_ID,
    grantId: await mintGrant(),
    gty: 'authorization_code',
    scope: SCOPE,
  }).save()
}

async function mint(count: number, one: () => Promise<string>): Promise<string[]> {
  const values: string[] = []
  for (let i = 0; i < count; i++) values.push(await one())
  return values
}

process.on('message', async (message: unknown) => {
  if (typeof message !== 'object' || message === null) return // 'usage' is bench/probe.ts's
  const request = message as PeerRequest
  if (request.kind === 'codes') process.send?.({ codes: await mint(request.count, mintCode) } satisfies PeerAnswer)
  else if (request.kind === 'tokens')
    process.send?.({ tokens: await mint(request.count, mintToken) } satisfies PeerAnswer)
})

console.log(
  `listening ${port} token=${ROUTES.token} introspection=${ROUTES.introspection} revocation=${ROUTES.revocation}`,
)
