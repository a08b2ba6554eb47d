// Interop test: a real OAuth client library, oauth4webapi, drives Latch exactly as an application
// would. It knows only the issuer URL: every endpoint comes from discovery (RFC 8414), the
// authorization response goes through the library's `iss` and `state` checks (RFC 9207), and
// every token, introspection, revocation and userinfo answer goes through its response parsers.
// Where the library and Latch disagree, the assertion stays and a comment names the rule.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import * as oauth from 'oauth4webapi'
import { unescapeHtml } from './html.ts'
import { START, startLatch } from './harness.ts'
import type { TestServer } from './harness.ts'

// --- Harness ----------------------------------------------------------------------

const ME = 'https://example.com/'
const PROFILE = { name: 'Ada Lovelace', url: ME, photo: 'https://example.com/ada.jpg' }

/** The application: a client identifier on 127.0.0.1 (IA §3.3) with a redirect on the same origin. */
const client: oauth.Client = { client_id: 'http://127.0.0.1:8080/' }
const clientAuth = oauth.None()
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'

/** Latch speaks plain http on 127.0.0.1; the library refuses http unless told otherwise. */
const insecure = { [oauth.allowInsecureRequests]: true } as const

/** Discovery from the issuer alone, as RFC 8414 §3 describes it. */
async function discover(issuer: string): Promise<oauth.AuthorizationServer> {
  const issuerUrl = new URL(issuer)
  const response = await oauth.discoveryRequest(issuerUrl, { algorithm: 'oauth2', ...insecure })
  return oauth.processDiscoveryResponse(issuerUrl, response)
}

type Authorization = { state: string; codeVerifier: string; location: URL }

/**
 * What the application and the owner's browser do: build the authorization URL with PKCE, open
 * it, read the consent form, submit it, and return where the browser is sent next.
 */
async function authorize(
  as: oauth.AuthorizationServer,
  options: { scope?: string; resource?: string[]; decision?: 'approve' | 'deny'; granted?: string[] } = {},
): Promise<Authorization> {
  const state = oauth.generateRandomState()
  const codeVerifier = oauth.generateRandomCodeVerifier()
  const url = new URL(as.authorization_endpoint ?? '')
  url.searchParams.set('response_type', 'code')
  url.searchParams.set('client_id', client.client_id)
  url.searchParams.set('redirect_uri', REDIRECT_URI)
  url.searchParams.set('state', state)
  url.searchParams.set('code_challenge', await oauth.calculatePKCECodeChallenge(codeVerifier))
  url.searchParams.set('code_challenge_method', 'S256')
  if (options.scope !== '') url.searchParams.set('scope', options.scope ?? 'profile create')
  for (const resource of options.resource ?? []) url.searchParams.append('resource', resource)

  const page = await fetch(url, { redirect: 'manual' })
  const html = await page.text()
  assert.equal(page.status, 200, html)
  const action = /<form method="post" action="([^"]+)"/.exec(html)?.[1]
  const request = /name="request" value="([^"]+)"/.exec(html)?.[1]
  const csrf = /name="csrf" value="([^"]+)"/.exec(html)?.[1]
  const cookie = page.headers
    .getSetCookie()
    .find((line) => line.startsWith('latch_csrf='))
    ?.split(';')[0]
  assert.ok(action && request && csrf && cookie)

  const body = new URLSearchParams({
    request: unescapeHtml(request),
    csrf: unescapeHtml(csrf),
    decision: options.decision ?? 'approve',
  })
  for (const scope of options.granted ?? ['profile', 'create']) body.append('scope', scope)
  const answer = await fetch(new URL(unescapeHtml(action), url), {
    method: 'POST',
    redirect: 'manual',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', Cookie: cookie },
    body,
  })
  assert.equal(answer.status, 303)
  return { state, codeVerifier, location: new URL(answer.headers.get('location') ?? '') }
}

/** Validates the authorization response and exchanges its code, all through the library. */
async function exchangeCode(
  as: oauth.AuthorizationServer,
  authorization: Authorization,
  additionalParameters?: URLSearchParams,
): Promise<oauth.TokenEndpointResponse> {
  const params = oauth.validateAuthResponse(as, client, authorization.location, authorization.state)
  const response = await oauth.authorizationCodeGrantRequest(
    as,
    client,
    clientAuth,
    params,
    REDIRECT_URI,
    authorization.codeVerifier,
    { ...insecure, additionalParameters },
  )
  return oauth.processAuthorizationCodeResponse(as, client, response)
}

async function signIn(
  as: oauth.AuthorizationServer,
  options: { scope?: string; granted?: string[] } = {},
): Promise<oauth.TokenEndpointResponse> {
  return exchangeCode(as, await authorize(as, options))
}

async function refresh(
  as: oauth.AuthorizationServer,
  refreshToken: string,
  additionalParameters?: URLSearchParams,
): Promise<oauth.TokenEndpointResponse> {
  const response = await oauth.refreshTokenGrantRequest(as, client, clientAuth, refreshToken, {
    ...insecure,
    additionalParameters,
  })
  return oauth.processRefreshTokenResponse(as, client, response)
}

/** Introspects as the resource server that names itself `resource` (or none, as IndieAuth's do). */
async function introspect(
  as: oauth.AuthorizationServer,
  token: string,
  resource?: string,
): Promise<oauth.IntrospectionResponse> {
  const additionalParameters: Record<string, string> = resource === undefined ? {} : { resource }
  const response = await oauth.introspectionRequest(as, client, clientAuth, token, {
    ...insecure,
    additionalParameters,
  })
  return oauth.processIntrospectionResponse(as, client, response)
}

async function revoke(as: oauth.AuthorizationServer, token: string): Promise<void> {
  const response = await oauth.revocationRequest(as, client, clientAuth, token, insecure)
  await oauth.processRevocationResponse(response)
}

/** Matches the error the library throws for an OAuth error in a JSON body (RFC 6749 §5.2). */
function responseBodyError(error: string) {
  return (err: unknown) => err instanceof oauth.ResponseBodyError && err.error === error && err.status === 400
}

/** Matches the error the library throws for a `WWW-Authenticate` challenge (RFC 6750 §3). */
function challengeError(status: number, error: string) {
  return (err: unknown) =>
    err instanceof oauth.WWWAuthenticateChallengeError &&
    err.status === status &&
    err.cause.some((challenge) => challenge.scheme === 'bearer' && challenge.parameters.error === error)
}

// --- Tests ------------------------------------------------------------------------

describe('Interop with oauth4webapi, a real client library', () => {
  let latch: TestServer
  let as: oauth.AuthorizationServer
  before(async () => {
    latch = await startLatch({
      ME,
      PROFILE_NAME: PROFILE.name,
      PROFILE_PHOTO: PROFILE.photo,
      PROFILE_EMAIL: 'ada@example.com',
    })
    as = await discover(latch.issuer)
  })
  after(() => latch.close())

  it('discovers every endpoint from the issuer alone', async () => {
    const metadata = await discover(latch.issuer)
    assert.equal(metadata.issuer, latch.issuer)
    for (const endpoint of [
      'authorization_endpoint',
      'token_endpoint',
      'introspection_endpoint',
      'revocation_endpoint',
      'userinfo_endpoint',
    ] as const) {
      assert.ok(metadata[endpoint]?.startsWith(latch.issuer), endpoint)
    }
    assert.deepEqual(metadata.code_challenge_methods_supported, ['S256'])
    assert.deepEqual(metadata.token_endpoint_auth_methods_supported, ['none'])
    assert.equal(metadata.client_id_metadata_document_supported, true)
    assert.equal(metadata.authorization_response_iss_parameter_supported, true)
    assert.ok(metadata.grant_types_supported?.includes('refresh_token'))
  })

  it('completes the authorization code flow with PKCE, and the library accepts the iss of the response', async () => {
    const authorization = await authorize(as)
    assert.equal(authorization.location.origin + authorization.location.pathname, REDIRECT_URI)
    assert.equal(authorization.location.searchParams.get('iss'), as.issuer)
    const tokens = await exchangeCode(as, authorization)
    assert.equal(typeof tokens.access_token, 'string')
    assert.equal(tokens.token_type, 'bearer') // the library lowercases it
    assert.equal(tokens.scope, 'profile create')
    assert.equal(typeof tokens.expires_in, 'number')
    assert.equal(typeof tokens.refresh_token, 'string')
    assert.equal(tokens.me, ME)
    assert.deepEqual(tokens.profile, PROFILE)
  })

  it('gets a token for a resource (RFC 8707) with an empty scope, whose introspection names it as aud', async () => {
    const notes = 'https://notes.example.com/mcp'
    const authorization = await authorize(as, { scope: '', resource: [notes], granted: [] })
    const tokens = await exchangeCode(as, authorization, new URLSearchParams({ resource: notes }))
    assert.equal(tokens.scope, '') // none granted, and said so (RFC 6749 §5.1)
    assert.equal((await introspect(as, tokens.access_token)).active, false) // to a server that names none
    const introspection = await introspect(as, tokens.access_token, notes)
    assert.equal(introspection.active, true)
    assert.equal(introspection.aud, notes)
    assert.equal(introspection.scope, '')
  })

  it('narrows the audience on exchange and refresh, keeps the grant for later refreshes, never widens it', async () => {
    const [notes, files] = ['https://notes.example.com/mcp', 'https://files.example.com/mcp']
    const authorization = await authorize(as, { resource: [notes, files] })
    const first = await exchangeCode(as, authorization, new URLSearchParams({ resource: notes }))
    assert.equal((await introspect(as, first.access_token, notes)).aud, notes)
    const second = await refresh(as, first.refresh_token ?? '', new URLSearchParams({ resource: files }))
    assert.equal((await introspect(as, second.access_token, files)).aud, files)
    const third = await refresh(as, second.refresh_token ?? '')
    assert.deepEqual((await introspect(as, third.access_token, files)).aud, [notes, files])
    const elsewhere = new URLSearchParams({ resource: 'https://elsewhere.example.com/' })
    await assert.rejects(refresh(as, third.refresh_token ?? '', elsewhere), responseBodyError('invalid_target'))
  })

  it('rejects a code redeemed twice with invalid_grant, and revokes the tokens issued from it', async () => {
    const authorization = await authorize(as)
    const tokens = await exchangeCode(as, authorization)
    await assert.rejects(exchangeCode(as, authorization), responseBodyError('invalid_grant'))
    assert.equal((await introspect(as, tokens.access_token)).active, false)
    await assert.rejects(refresh(as, tokens.refresh_token ?? ''), responseBodyError('invalid_grant'))
  })

  it('rotates the refresh token, keeping me and scope in the new token response', async () => {
    const first = await signIn(as)
    const second = await refresh(as, first.refresh_token ?? '')
    assert.notEqual(second.access_token, first.access_token)
    assert.notEqual(second.refresh_token, first.refresh_token)
    assert.equal(typeof second.refresh_token, 'string')
    assert.equal(second.token_type, 'bearer')
    assert.equal(second.scope, 'profile create')
    assert.equal(second.me, ME)
    assert.equal(typeof second.expires_in, 'number')
    assert.equal((await introspect(as, second.access_token)).active, true)
  })

  it('rejects a replayed refresh token with invalid_grant and revokes its whole family', async () => {
    const first = await signIn(as)
    const second = await refresh(as, first.refresh_token ?? '')
    latch.advance(31) // past REFRESH_TOKEN_GRACE: no longer a retry
    await assert.rejects(refresh(as, first.refresh_token ?? ''), responseBodyError('invalid_grant'))
    assert.equal((await introspect(as, first.access_token)).active, false)
    assert.equal((await introspect(as, second.access_token)).active, false)
    await assert.rejects(refresh(as, second.refresh_token ?? ''), responseBodyError('invalid_grant'))
    latch.advance(-31) // back to START, which later tests assert times against
  })

  it('introspects a live access token as active, for whom and for what', async () => {
    const tokens = await signIn(as)
    const introspection = await introspect(as, tokens.access_token)
    assert.equal(introspection.active, true)
    assert.equal(introspection.me, ME)
    assert.equal(introspection.client_id, client.client_id)
    assert.equal(introspection.scope, 'profile create')
    assert.equal(introspection.iat, Math.floor(START / 1000))
    assert.equal(introspection.exp, Math.floor(START / 1000) + (tokens.expires_in ?? 0))
  })

  it('introspects a refresh token and an unknown token as inactive', async () => {
    const tokens = await signIn(as)
    assert.deepEqual({ ...(await introspect(as, tokens.refresh_token ?? '')) }, { active: false })
    assert.deepEqual({ ...(await introspect(as, oauth.generateRandomState())) }, { active: false })
  })

  it('revokes an access token, which then introspects as inactive', async () => {
    const tokens = await signIn(as)
    await revoke(as, tokens.access_token)
    assert.deepEqual({ ...(await introspect(as, tokens.access_token)) }, { active: false })
    await revoke(as, tokens.access_token) // revoking again is still a success (RFC 7009 §2.2)
  })

  it('revokes a refresh token together with the access tokens of its grant', async () => {
    const tokens = await signIn(as)
    await revoke(as, tokens.refresh_token ?? '')
    assert.equal((await introspect(as, tokens.access_token)).active, false)
    await assert.rejects(refresh(as, tokens.refresh_token ?? ''), responseBodyError('invalid_grant'))
  })

  it('returns the profile from the userinfo endpoint to a token with the profile scope', async () => {
    const tokens = await signIn(as)
    const response = await oauth.userInfoRequest(as, client, tokens.access_token, insecure)
    // OpenID Connect Core §5.3.2 requires `sub`, which the IndieAuth profile object lacks; Latch
    // adds `sub` (the owner's `me`) so that libraries like this one accept the answer.
    const claims = await oauth.processUserInfoResponse(as, client, ME, response)
    assert.deepEqual({ ...claims }, { sub: ME, ...PROFILE }) // no email: the email scope was not granted
  })

  it('answers userinfo to a token without the profile scope with an insufficient_scope challenge', async () => {
    const tokens = await signIn(as, { scope: 'create', granted: ['create'] })
    const response = await oauth.userInfoRequest(as, client, tokens.access_token, insecure)
    await assert.rejects(
      oauth.processUserInfoResponse(as, client, oauth.skipSubjectCheck, response),
      challengeError(403, 'insufficient_scope'),
    )
  })

  it('answers userinfo to a revoked token with an invalid_token challenge', async () => {
    const tokens = await signIn(as)
    await revoke(as, tokens.access_token)
    const response = await oauth.userInfoRequest(as, client, tokens.access_token, insecure)
    await assert.rejects(
      oauth.processUserInfoResponse(as, client, oauth.skipSubjectCheck, response),
      challengeError(401, 'invalid_token'),
    )
  })

  it('surfaces a denied consent as access_denied, after the iss and state checks pass', async () => {
    const { location, state } = await authorize(as, { decision: 'deny' })
    assert.throws(
      () => oauth.validateAuthResponse(as, client, location, state),
      (err: unknown) => err instanceof oauth.AuthorizationResponseError && err.error === 'access_denied',
    )
  })

  it('lets the library reject an authorization response with the wrong state', async () => {
    const { location } = await authorize(as)
    assert.throws(() => oauth.validateAuthResponse(as, client, location, oauth.generateRandomState()), {
      code: oauth.INVALID_RESPONSE,
      message: 'unexpected "state" response parameter value',
    })
  })
})
