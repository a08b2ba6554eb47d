/*!
 * Latch: an IndieAuth authorization server in one file, on node:http and node:crypto.
 *
 * A person's browser is sent to `GET /auth`; the owner signs in and approves; the client gets a
 * code. The client redeems the code for the owner's profile URL (`POST /auth`) or exchanges it
 * for an access token (`POST /token`). Resource servers check tokens (`POST /introspect`) and
 * clients revoke them (`POST /revoke`). PKCE with S256 is required; codes are single use and
 * bound to `client_id`, `redirect_uri` and `code_challenge` (at `POST /auth`, the first two are
 * checked when the client sends them; see `checkCode`).
 *
 * Quick start:
 *
 *     npm install && npx tsx server.ts   # serves http://127.0.0.1:3000, no configuration needed
 *     npm install && npm test      # runs the tests
 *
 * Embedding (nothing listens and nothing reads `process.env` until you ask; the README says more):
 *
 *     import { createHandler, createLatchServer, loadConfig, openStore } from './server.ts'
 *     const { PASSWORD_HASH } = process.env // from `npx tsx server.ts hash-password`
 *     const config = loadConfig({ ISSUER: 'https://auth.example.com', ME: 'https://example.com/', PASSWORD_HASH })
 *     const handler = createHandler({ config, store: await openStore(config) }) // the journal at DATA_FILE
 *     createLatchServer(undefined, undefined, console.log).on('request', handler).listen(3000, '127.0.0.1')
 *
 * Reading guide. The file has two parts. Part 1, "The protocol", is IndieAuth: the nouns and the
 * `Store` contract, errors, secrets, PKCE and parameters, identifiers and what a client publishes,
 * scopes and lifetimes, then the endpoints in the order a client meets them (metadata,
 * authorization, consent, redemption, token, introspection, revocation, the Bearer endpoints, the
 * home page), then the route table and `createHandler`. To learn IndieAuth, read to the end of
 * Part 1. Part 2, "What it leans on", is the machinery: the log, HTTP and the server, pages,
 * sessions and sign-in throttling, the owner's password and passkeys (WebAuthn), the owner's own
 * pages, client fetching, the stores and the journal, performance, configuration, `main()`. What
 * each endpoint answers, its statuses and error codes, is Latch's wire contract: the README's
 * table of endpoints and the sections after it, which server.test.ts holds Latch to.
 *
 * @see https://indieauth.spec.indieweb.org/ IndieAuth Living Standard (2024-07-11)
 * @see https://www.rfc-editor.org/rfc/rfc6749 OAuth 2.0
 * @see https://www.rfc-editor.org/rfc/rfc7636 PKCE
 * @see https://www.w3.org/TR/webauthn-3/ WebAuthn Level 3 (passkeys)
 * @license MIT
 */

// =================================================================================================
// PART 1: THE PROTOCOL
// The nouns, the checks and the endpoints of IndieAuth, in the order a client meets them. To learn
// IndieAuth, read to the end of this part: it calls what Part 2 provides by names that say what
// they do (`readForm`, `sendJson`, `findClient`, `checkSignIn`, `store.markCodeUsed`, ...).
// =================================================================================================

// --- Imports --------------------------------------------------------------------
// node: modules only. Latch has no runtime dependencies.

import { createServer, request as httpRequest, STATUS_CODES } from 'node:http'
import type {
  Agent,
  IncomingHttpHeaders,
  IncomingMessage,
  OutgoingHttpHeaders,
  Server,
  ServerResponse,
} from 'node:http'
import { request as httpsRequest } from 'node:https'
import { lookup } from 'node:dns/promises'
import type { LookupAddress } from 'node:dns'
import { BlockList, connect, createServer as createNetServer, isIP, isIPv6, SocketAddress } from 'node:net'
import type { Server as NetServer, Socket } from 'node:net'
import * as crypto from 'node:crypto'
import { createHmac, createPublicKey, randomBytes, randomFillSync, scrypt, timingSafeEqual, verify } from 'node:crypto'
import type { KeyObject } from 'node:crypto'
import {
  closeSync,
  constants as fsConstants,
  existsSync,
  fstatSync,
  openSync,
  readSync,
  readlinkSync,
  realpathSync,
  statSync,
  writeSync,
} from 'node:fs'
import type { Stats } from 'node:fs'
import {
  access,
  lstat,
  mkdir,
  open,
  readFile,
  readdir,
  readlink,
  realpath,
  rename,
  rm,
  stat,
  truncate,
} from 'node:fs/promises'
import type { FileHandle } from 'node:fs/promises'
import type { Writable } from 'node:stream'
import { basename, dirname, isAbsolute, join, resolve } from 'node:path'
import { isatty } from 'node:tty'
import { domainToUnicode, fileURLToPath } from 'node:url'

// Node 20.12 or later (21.7 or later on Node 21): node:crypto's one-shot `hash` came then. An
// older Node is told so here, before anything runs, rather than failing on a missing export.
if (typeof crypto.hash !== 'function') {
  const needed = 'Latch needs Node 20.12 or later (21.7 or later on Node 21)'
  throw new Error(`${needed}, and this is Node ${process.versions.node}: install a newer one`)
}
const { hash } = crypto

// --- Types ----------------------------------------------------------------------
// The protocol's nouns. Times are milliseconds since the epoch, as `now()` returns them.

/**
 * Everything Latch needs to know to serve; made by `loadConfig` from the environment. Each field
 * is a setting of the same name in capitals, which the README's table and the comments here use:
 * `DATA_FILE` is `dataFile`, `ACCESS_TOKEN_TTL` is `accessTokenTtlSeconds`, and the `PROFILE_`
 * settings make `profile` (see `SETTINGS`).
 */
export type Config = {
  /** Port to listen on; 0 asks the system for any free port. */
  port: number
  /** Interface to bind: an address as a URL writes it (without brackets), or a name; `localhost` is 127.0.0.1. */
  host: string
  /** Public base URL without a trailing slash; every endpoint URL starts with it. */
  issuer: string
  /** The owner's canonical profile URL: every code and token carries it. */
  me: string
  /** scrypt hash of the owner's password, or undefined when consent needs no password. */
  passwordHash: string | undefined
  /** False once the owner signs in with passkeys only: the password is then refused. */
  passwordSignIn: boolean
  /** The journal file codes, grants, tokens, sessions and passkeys survive restarts in, or `memory`. */
  dataFile: string
  codeTtlSeconds: number
  accessTokenTtlSeconds: number
  /** A refresh token expires after this long without use. */
  refreshTokenTtlSeconds: number
  /** How long a rotated refresh token may be presented again, as a retry, without revoking its grant. */
  refreshTokenGraceSeconds: number
  /** How long the owner stays signed in after signing in, with the password or a passkey. */
  sessionTtlSeconds: number
  /** When set, `/introspect` callers must send it as a Bearer credential. */
  introspectionSecret: string | undefined
  /** Whether client discovery may fetch from private addresses (a LAN); loopback never. */
  clientFetchPrivate: boolean
  /** What the `profile` and `email` scopes show of the owner (IndieAuth §5.3.4). */
  profile: Profile
  /** Addresses and ranges (`10.0.0.0/8`) of proxies whose `X-Forwarded-For` tells the client's address. */
  trustProxy: string[]
  /** `text`: one line a person reads; `json`: one JSON object per line, for log collectors. */
  logFormat: 'text' | 'json'
}

/** The owner's profile information; `url` defaults to `me`. */
export type Profile = { name?: string; url: string; photo?: string; email?: string }

/** An authorization request that passed validation and waits for the owner's decision. */
export type PendingRequest = {
  client_id: string
  /** The name the client publishes, when discovery found one. */
  client_name: string | undefined
  redirect_uri: string
  state: string | undefined
  code_challenge: string
  /** The scopes the client asked for, in its order, without duplicates. */
  scope: string[]
  /** The services (RFC 8707 resource indicators) the client wants to reach; empty for IndieAuth. */
  resource: string[]
  /** The `me` the client suggested: shown to the owner, never trusted. */
  meHint: string | undefined
  /** The hash (`hashSecret`) of the CSRF cookie of the browser that opened the request. */
  csrfHash: string
  /**
   * Who opened it: an address as `CONNECTION_LIMITS` groups them (an IPv6 /64), or undefined for
   * loopback. A full store drops a request of the address that holds the most (`MemoryStore`).
   */
  openedBy?: string
  expiresAt: number
}

/** An authorization code as stored: under the hash (`hashSecret`) of its value. */
export type AuthorizationCode = {
  client_id: string
  client_name: string | undefined
  redirect_uri: string
  code_challenge: string
  /** The scopes the owner granted; with no resource either, the code only proves identity. */
  scope: string[]
  /** The services the owner let the client reach (RFC 8707): the audience of its tokens. */
  resource: string[]
  me: string
  /** The access token lifetime: the one the owner chose on the consent page, or `ACCESS_TOKEN_TTL`. */
  accessTokenTtlSeconds: number
  /** How long the app's access lasts from the approval, refreshing included; undefined: until revoked. */
  approvedForSeconds?: number
  issuedAt: number
  expiresAt: number
  /** Set once the code has been redeemed; kept so that a replay can be recognised. */
  usedAt: number | undefined
}

/**
 * What the owner approved for one client: the family of tokens issued from one code. Its id is
 * the hash of that code, so a replayed code finds the grant to revoke. Each refresh issues a new
 * refresh token and retires the one sent (rotation): the retired one sent again within
 * `REFRESH_TOKEN_GRACE` is taken for a retry whose answer was lost, and after that for a stolen
 * copy, which revokes the grant (`refreshGrant` tells the story).
 */
export type Grant = {
  client_id: string
  client_name: string | undefined
  me: string
  /** The scopes the owner granted; refreshed tokens may narrow them, never widen them. */
  scope: string[]
  /** The services the owner let the client reach; as with scope, a refresh may narrow them only. */
  resource: string[]
  accessTokenTtlSeconds: number
  approvedAt: number
  lastUsedAt: number
  /** When the owner's approval ends, refreshing included, as chosen on the consent page; undefined: never. */
  endsAt?: number
  /** The latest expiry of its tokens: a grant lives as long as one of them may. */
  expiresAt: number
  /**
   * The hash of its refresh token rotated last: one that may come again, as a retry within
   * `REFRESH_TOKEN_GRACE`. One rotated before it is a reuse, since the client went on; unless
   * Latch's own store knows it did not (`MemoryStore.redeem`: two refreshes sent at once).
   */
  lastRotated?: string
}

/** An access or refresh token as stored: under the hash (`hashSecret`) of its value. */
export type Token = {
  kind: 'access' | 'refresh'
  grantId: string
  scope: string[]
  /** The services the token is for: its audience (`aud`). Empty for an IndieAuth token. */
  resource: string[]
  issuedAt: number
  expiresAt: number
  /** Refresh tokens only: set once rotated, and kept so that a reuse can be recognised. */
  usedAt: number | undefined
}

/** What one token exchange or refresh stores: what it redeems, and the grant and tokens it issues. */
export type TokenIssue = {
  /**
   * The hash of the code or refresh token redeemed, which can be redeemed once only; a refresh
   * token used at or after `retriedSince` may be redeemed again, as a retry within the grace period.
   */
  redeemed: { kind: 'code' | 'refresh'; hash: string; retriedSince?: number }
  grantId: string
  grant: Grant
  /** The new tokens, each under the hash of its value. */
  tokens: [hash: string, token: Token][]
}

/**
 * The owner, signed in: stored under the hash (`hashSecret`) of the session cookie's value.
 * `passwordTag` tells which password it was started with (see `passwordTag`).
 */
export type Session = { createdAt: number; expiresAt: number; passwordTag: string }

/** A passkey of the owner, as stored under its credential id (base64url). */
export type Passkey = {
  /** What the owner called it: "Phone", "Laptop". */
  name: string
  /** The public key, as SubjectPublicKeyInfo DER in base64url. */
  publicKey: string
  /** Its COSE algorithm: -7 ES256, -8 EdDSA (Ed25519), -257 RS256. */
  algorithm: number
  /** The signature counter the device sent last; 0 for devices that keep none, as synced passkeys do. */
  counter: number
  addedAt: number
  lastUsedAt: number | undefined
  /**
   * The WebAuthn user handle it was made with, which the device sends back at each sign-in: made
   * from `ME` and `ISSUER` at the time, so a new `ME` keeps it working. Absent on a passkey stored
   * before it was kept, until it signs in with the handle Latch makes now.
   */
  userHandle?: string
  /** The host name it was made for (its RP ID), the only one it works on; absent as `userHandle` may be. */
  rpId?: string
}

/**
 * Where codes and tokens live. Keys are hashes (`hashSecret`); raw secrets never reach a store
 * (passkeys are kept under their credential ids, which are no secret, though only the signed-in
 * owner is shown them). Single use is a store operation: `markCodeUsed` and `redeemForTokens`
 * must be atomic, so that of two requests with one code only the first gets tokens. How to put
 * a database behind Latch (the SQL or Redis for each step, what to throw when it fails, what to
 * return) is where the storage section begins, in Part 2.
 */
export interface Store {
  /**
   * Anyone can open a consent page, so a store bounds how many requests it keeps: `MemoryStore`
   * keeps 1,000, and when full drops the oldest of the address that holds the most (`openedBy`).
   */
  savePending(id: string, request: PendingRequest, now: number): Promise<void>
  findPending(id: string, now: number): Promise<PendingRequest | undefined>
  /** Returns the pending request and deletes it, in one step. */
  takePending(id: string, now: number): Promise<PendingRequest | undefined>
  saveCode(hash: string, code: AuthorizationCode, now: number): Promise<void>
  /** Returns an unexpired code, used or not. */
  findCodeUsedOrNot(hash: string, now: number): Promise<AuthorizationCode | undefined>
  /** Marks an unexpired code used, in one step: true only for the first caller. */
  markCodeUsed(hash: string, now: number): Promise<boolean>
  saveGrant(id: string, grant: Grant, now: number): Promise<void>
  /** Returns a copy the caller owns: a token exchange updates it before saving it back. */
  findGrant(id: string, now: number): Promise<Grant | undefined>
  /** Every unexpired grant, oldest first. */
  listGrants(now: number): Promise<[string, Grant][]>
  /**
   * Deletes a grant, which ends every token of its family, and keeps it from being saved again:
   * a refresh or an exchange that read it just before must not bring it back.
   */
  revokeGrant(id: string, now: number): Promise<void>
  /**
   * The owner's "Revoke all", in one step: revokes every grant approved at or before
   * `approvedBy`, to the second, and deletes every code issued by then, used or not, revoking
   * its grant's id too (a grant's id is its code's hash), so that no code approved before
   * becomes a grant after. Returns how many apps lost their access: the grants, and each client
   * with a code not redeemed yet that no grant or other code already counted.
   */
  revokeApprovedBy(approvedBy: number, now: number): Promise<number>
  /**
   * Notes that a token of the grant was used; a store may keep this in memory only. A failure to
   * keep it (`NotStored`) refuses nothing.
   */
  touchGrant(id: string, now: number): Promise<void>
  saveToken(hash: string, token: Token, now: number): Promise<void>
  /** Returns an unexpired token, used or not. */
  findToken(hash: string, now: number): Promise<Token | undefined>
  /**
   * Redeems a code or a refresh token for new tokens, in one step: marks what is redeemed used
   * (if it is unexpired and unused), then saves the grant and the tokens. True for the first
   * caller, and for a retry: a refresh token used at or after `redeemed.retriedSince` that is
   * still the one its grant rotated last (`Grant.lastRotated`, which the first caller sets).
   * Latch's own stores also take, within the grace, a retry of a refresh token none of whose
   * successors is used yet (two refreshes sent at once leave two successors, one for each tab).
   * Nothing is saved for any other.
   */
  redeemForTokens(issue: TokenIssue, now: number): Promise<boolean>
  deleteToken(hash: string): Promise<void>
  saveSession(hash: string, session: Session, now: number): Promise<void>
  findSession(hash: string, now: number): Promise<Session | undefined>
  deleteSession(hash: string): Promise<void>
  /** Deletes every session: the owner signed out everywhere. */
  deleteAllSessions(): Promise<void>
  /** Saves a passkey, new or with its counter and last use updated; passkeys never expire. */
  savePasskey(id: string, passkey: Passkey, now: number): Promise<void>
  findPasskey(id: string): Promise<Passkey | undefined>
  /** Every passkey, oldest first. */
  listPasskeys(): Promise<[string, Passkey][]>
  deletePasskey(id: string): Promise<void>
}

/** What `createHandler` takes: `config`, and `store` unless `DATA_FILE` is `memory`; the rest have defaults. */
export type HandlerOptions = {
  config: Config
  /**
   * Where codes, grants and tokens are kept: `await openStore(config)`. Only with `DATA_FILE`
   * `memory` may it be left out, for a new `MemoryStore`. Handlers of one store and one config
   * share what they keep in memory too (password tries, discovery's cache; see `Kept`), so one
   * may be made at each request.
   */
  store?: Store
  /**
   * The clock, in milliseconds; tests pass one they can advance. Defaults to `Date.now`. Lockouts,
   * refresh days and discovery's cache follow the clock of a Latch's first handler (see `Kept`).
   */
  now?: () => number
  /**
   * Receives one line per request, and one per security event, discovery failure, warning or
   * server error. Defaults to `console.log`.
   */
  log?: (line: string) => void
  /** How client information is fetched; tests point it at local servers. */
  clientFetch?: ClientFetchOptions
  /**
   * Aborting it stops the handler's share of the timer that sweeps expired entries from the store
   * every 100 ms: the timer stops once every handler of the store and config is stopped, and never
   * if one was made without a signal.
   */
  signal?: AbortSignal
}

/**
 * What every endpoint handler receives besides the request and the response: the settings, the
 * store and the clock, and then what a Latch keeps in memory only, shared by its handlers (Part
 * 2's `Kept`): password tries, client lookups, passkey challenges and the like. A reader of the
 * protocol needs the first three; the rest is explained where it is used.
 */
type Context = {
  config: Config
  store: Store
  now: () => number
  /**
   * The clock of what Latch keeps in memory for a while: lockouts, the day of refreshes, the apps
   * it looked up or failed to, the answer remembered for a second press of a consent button, and
   * passkey challenges; and the time "Revoke all" records as asked, unless an approval it lists is later.
   * It follows `now` forward, and stands still while `now` is set back, so that a wall clock set
   * back an hour does not make a two-second lockout last an hour.
   */
  steadyNow: () => number
  log: (line: string) => void
  signInAttempts: { byAddress: Map<string, PasswordAttempts>; total: PasswordAttempts }
  passwordSlots: PasswordSlots
  clientFetch: ClientFetchOptions
  /** Client information by client_id, kept as long as its Cache-Control allows. */
  clients: Map<string, { info: ClientInfo; expiresAt: number }>
  /** Clients whose fetch failed, with when to try again, and whether their site was busy (`ClientSiteBusy`). */
  failedClients: Map<string, { until: number; busy: boolean }>
  /** Fetches under way, by client_id, for requests that arrive meanwhile to share. */
  clientLookups: Map<string, Promise<ClientLookup>>
  /** The lookups under way that each address started, by `CONNECTION_LIMITS.groupOf`. */
  lookupsBy: Map<string, number>
  clientFetchSlots: Slots
  /** The proxies of `TRUST_PROXY`, whose forwarding headers are believed. */
  trustedProxies: BlockList | undefined
  /** Refreshes of each grant in its current day: since when, and how many. */
  refreshes: Map<string, { since: number; count: number }>
  /**
   * The key of the passkey challenges' HMAC, the challenges used and when each expires, and the
   * passkey changes under way, which run one at a time.
   */
  passkeys: { key: Buffer; used: Map<string, number>; changes: Promise<unknown> }
  /** When this Latch's first handler was made: a store may keep a grant's last use in memory only, lost before. */
  startedAt: number
  /** The grants of tokens for scripts being made, each with the end of its last try: one form sent twice waits. */
  scriptGrantsUnderWay: Map<string, Promise<void>>
  /** Grants of tokens for scripts stored without their token (a full disk): the form sent again makes it. */
  scriptGrantsWithoutToken: Set<string>
  /** Tokens for scripts made in the last seconds, by grant, for a second press of the form's button. */
  scriptTokensMadeLately: Map<string, { token: string; until: number }>
  /** Consent answered lately, by the hash of its request id, for a second press of its button (`rememberAnswer`). */
  answered: Map<string, Answer & { until: number }>
}

/** Password attempts from one address, or from all: how many, the last, and until when the next must wait. */
export type PasswordAttempts = { count: number; lastAt: number; lockedUntil: number }

/** Tasks running, and the tasks waiting for one of them to end. */
export type Slots = { running: number; waiting: (() => void)[] }

/** The slots of `withPasswordSlot`: the scrypt checks running, and those waiting for one. */
export type PasswordSlots = Slots

/** Query or form parameters: every value of every name, in the order sent. */
export type Params = Map<string, string[]>

// --- Errors ---------------------------------------------------------------------
// RFC 6749 §5.2  https://www.rfc-editor.org/rfc/rfc6749#section-5.2
// Handlers throw OAuthError; one catch in the router (`renderError`) renders it, as a page or as
// JSON. Anything else is a 500, a store's `NotStored` included. One handler catches its own:
// `GET /auth` sends an error to the app in a redirect, once its `redirect_uri` is trusted.

/** The HTTP status of each error code; an error thrown with a status of its own says so. */
const ERROR_STATUS: Record<string, number> = {
  // RFC 6749's, of the token endpoint (§5.2) and of the authorization endpoint (§4.1.2.1)
  invalid_request: 400,
  invalid_grant: 400,
  invalid_scope: 400,
  invalid_client: 401,
  unsupported_grant_type: 400,
  unsupported_response_type: 400,
  access_denied: 403,
  // RFC 8707 §2's, for a resource the owner did not approve; RFC 6750 §3.1's, of a Bearer token
  invalid_target: 400,
  invalid_token: 401,
  insufficient_scope: 403,
  // Latch's own, in the same JSON shape: no RFC names these. The daily refresh limit also
  // borrows `slow_down`, RFC 8628 §3.5's code for a client that asks too often (`countRefresh`).
  not_found: 404,
  method_not_allowed: 405,
  too_many_requests: 429,
}

/** The error code of a 401 to a request without credentials, which RFC 6750 §3.1 says should have none. */
const NO_ERROR_CODE = ''

/**
 * An error the client caused, with its OAuth error code, one plain sentence, the HTTP status and
 * any headers. The description is cleaned to the characters RFC 6749 §5.2 allows.
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-5.2
 */
export class OAuthError extends Error {
  readonly error: string
  readonly status: number
  readonly headers: Record<string, string>
  /** What the log says of it on a line of its own, when it is a security event (a replayed code, say). */
  readonly event: string | undefined

  constructor(
    error: string,
    description: string,
    options: { status?: number; headers?: Record<string, string>; event?: string } = {},
  ) {
    super(description.replace(/[^\x20\x21\x23-\x5b\x5d-\x7e]/g, '?'))
    this.error = error
    this.status = options.status ?? ERROR_STATUS[error] ?? 400
    this.headers = options.headers ?? {}
    this.event = options.event
  }
}

/**
 * A change the store did not take, so it did not happen: the disk is full, say, or the journal
 * was replaced by another hand (Part 2, "Durable storage"). The store has logged why; the
 * request is answered 500 `{"error":"server_error"}`, as the wire contract answers every failure
 * of the server, without the cause (a page says the change did not happen); a client can try
 * again once the disk has room.
 */
export class NotStored extends Error {
  constructor(cause: unknown) {
    super(`a change could not be stored: ${String(cause)}`, { cause })
  }
}

const NOT_STORED = new OAuthError(
  'server_error',
  'The change could not be stored, so it did not happen: try again later',
  { status: 500 },
)

// --- Small helpers --------------------------------------------------------------
// Secrets, PKCE and parameters. A few reuse buffers made once (`randomPool`, `challengeBytes`),
// cut a hash short (`cutHash`) or copy a string out of a larger one (`detached`): Performance
// internals, in Part 2, says why and how.

/** Base64url without padding (RFC 4648 §5), the encoding of codes, tokens and PKCE. */
export function base64url(bytes: Buffer): string {
  return bytes.toString('base64url')
}

/**
 * The key under which a secret is stored: its SHA-256, cut to the first 128 bits, base64url (22
 * characters). Finding a secret for a key stays out of reach; a million keys take 24 MB less
 * than whole hashes would.
 */
export function hashSecret(value: string): string {
  return cutHash(hash('sha256', value, 'base64url'))
}

/** A fresh code or token: 32 random bytes, base64url (43 characters). */
export function createSecret(): string {
  if (randomPool.used === randomPool.bytes.length) {
    randomFillSync(randomPool.bytes)
    randomPool.used = 0
  }
  const start = randomPool.used
  randomPool.used += 32
  const secret = randomPool.bytes.toString('base64url', start, randomPool.used)
  randomPool.bytes.fill(0, start, randomPool.used)
  return secret
}

/** What `createSecret` makes: a cookie or a form field of any other shape is not one of Latch's. */
const SECRET_FORMAT = /^[A-Za-z0-9_-]{43}$/

/** Compares two secrets in constant time, whatever their lengths. */
export function safeEqual(a: string, b: string): boolean {
  return timingSafeEqual(hash('sha256', a, 'buffer'), hash('sha256', b, 'buffer')) && a.length === b.length
}

/**
 * The PKCE S256 transformation: BASE64URL(SHA256(ASCII(code_verifier))).
 * @see https://www.rfc-editor.org/rfc/rfc7636#section-4.2
 */
export function computeCodeChallenge(verifier: string): string {
  return hash('sha256', verifier, 'base64url') // isCodeVerifier allows ASCII only, so UTF-8 is ASCII here
}

/**
 * True when a verifier matches a stored challenge, compared in constant time. Both are 43
 * characters (`isCodeChallenge` checked the stored one; a store that returns another length
 * fails here), so the bytes are compared as they are, with no hashing to hide a length.
 * @see https://www.rfc-editor.org/rfc/rfc7636#section-4.6
 */
export function verifyCodeChallenge(verifier: string, challenge: string): boolean {
  if (challenge.length !== 43) return false
  challengeBytes.computed.write(computeCodeChallenge(verifier), 'latin1')
  challengeBytes.stored.write(challenge, 'latin1')
  return timingSafeEqual(challengeBytes.computed, challengeBytes.stored)
}

/**
 * True when a `code_verifier` has the form RFC 7636 requires.
 * @see https://www.rfc-editor.org/rfc/rfc7636#section-4.1
 */
export function isCodeVerifier(value: string): boolean {
  return /^[A-Za-z0-9\-._~]{43,128}$/.test(value) // 43-128 characters of [A-Z] / [a-z] / [0-9] / "-" / "." / "_" / "~"
}

/** True when a `code_challenge` is a base64url SHA-256 digest: exactly 43 characters. */
export function isCodeChallenge(value: string): boolean {
  return /^[A-Za-z0-9_-]{43}$/.test(value)
}

/**
 * True when a scope token uses only the characters RFC 6749 allows.
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-3.3
 */
export function isScopeToken(value: string): boolean {
  return /^[\x21\x23-\x5b\x5d-\x7e]+$/.test(value) // scope-token = 1*( %x21 / %x23-5B / %x5D-7E )
}

// the Encoding Standard's "UTF-8 decode without BOM": the URL standard keeps a BOM in a value
const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true })

/**
 * Parses `application/x-www-form-urlencoded` text (a body or a query string): `+` is a space,
 * `%XX` a byte, and the bytes must be UTF-8. Throws `invalid_request` on a malformed escape or
 * invalid UTF-8. Pass a body as latin1 text so that each character is one byte.
 * @see https://url.spec.whatwg.org/#urlencoded-parsing
 */
export function parseForm(text: string): Params {
  const params: Params = new Map()
  // printable ASCII throughout, the usual case: then a name or value needs decoding only if it
  // has a `%` or a `+`, which is quicker to ask of each than whether it is printable. Else each is
  // asked (undefined), so that one raw byte does not send every other down the slow path
  const printable = PRINTABLE_ASCII.test(text) || undefined
  for (const pair of text.split('&')) {
    if (pair === '') continue
    const equals = pair.indexOf('=')
    const name = decodeFormComponent(equals === -1 ? pair : pair.slice(0, equals), printable)
    const value = equals === -1 ? '' : decodeFormComponent(pair.slice(equals + 1), printable)
    const values = params.get(name)
    if (values === undefined) params.set(name, [value])
    else values.push(value)
  }
  return params
}

/** Printable ASCII, the space left out: text that a form needs not decode, nor a log line quote. */
const PRINTABLE_ASCII = /^[\x21-\x7e]*$/

function decodeFormComponent(text: string, printable = PRINTABLE_ASCII.test(text)): string {
  if (printable) {
    const plus = text.includes('+')
    if (!plus && !text.includes('%')) return text // nothing to decode
    try {
      return decodeURIComponent(plus ? text.replaceAll('+', ' ') : text) // escapes in ASCII, decoded natively
    } catch {
      // a malformed escape or invalid UTF-8: the loop below says which
    }
  }
  const bytes = Buffer.alloc(text.length)
  let length = 0
  for (let i = 0; i < text.length; i++) {
    const char = text.charCodeAt(i)
    if (char === 0x2b) {
      bytes[length++] = 0x20 // "+" is a space
    } else if (char === 0x25) {
      const hex = text.slice(i + 1, i + 3)
      if (!/^[0-9A-Fa-f]{2}$/.test(hex))
        throw new OAuthError('invalid_request', 'The request has a malformed percent-escape')
      bytes[length++] = parseInt(hex, 16)
      i += 2
    } else if (char > 0xff) {
      throw new OAuthError('invalid_request', 'The request has characters that are not percent-encoded')
    } else {
      bytes[length++] = char
    }
  }
  try {
    return utf8.decode(bytes.subarray(0, length))
  } catch {
    throw new OAuthError('invalid_request', 'The request is not valid UTF-8')
  }
}

/** Whether a parsed JSON value is an object (not null, not an array). */
function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
}

/**
 * Returns the one value of a parameter, or undefined when it is absent or empty (RFC 6749 §3.1).
 * Throws `invalid_request` when it was sent with a value more than once (an empty one is none).
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-3.1
 */
export function getParam(params: Params, name: string): string | undefined {
  const values = params.get(name)
  if (values === undefined) return undefined
  if (values.length === 1) return values[0] === '' ? undefined : values[0]
  const sent = values.filter((value) => value !== '')
  if (sent.length > 1) throw new OAuthError('invalid_request', `Parameter ${name} was sent more than once`)
  return sent[0]
}

/** Like `getParam`, but a missing parameter is `invalid_request` too. */
export function requireParam(params: Params, name: string): string {
  const value = getParam(params, name)
  if (value === undefined) throw new OAuthError('invalid_request', `Parameter ${name} is missing`)
  return value
}

/** Splits a `scope` parameter into its tokens, dropping repeats, or throws `invalid_scope`. */
export function parseScope(value: string | undefined): string[] {
  const scopes = (value ?? '').split(' ').filter((scope) => scope !== '')
  for (const scope of scopes) {
    if (!isScopeToken(scope))
      throw new OAuthError('invalid_scope', 'The scope has a character that RFC 6749 does not allow')
  }
  return [...new Set(scopes)]
}

// --- Identifiers ----------------------------------------------------------------
// IndieAuth §3.2 (user profile URL) and §3.3 (client identifier), checked on the raw string:
// `new URL()` would silently remove dot segments and default ports before we could see them;
// and §4.2.2, the redirect URLs a client may use (RFC 8252 §7.3 for loopback ones).
// https://indieauth.spec.indieweb.org/#user-profile-url
// https://indieauth.spec.indieweb.org/#client-identifier

/**
 * The longest URL taken: a `client_id`, a `me` hint, a redirect URI, a resource, and what a
 * client's page publishes.
 */
const MAX_URL_LENGTH = 2_048

type UrlParts = { raw: string; scheme: string; userinfo: boolean; host: string; port: string; path: string }

function splitHttpUrl(raw: string): UrlParts | string {
  if (!/^[\x21-\x7e]+$/.test(raw)) return 'it contains spaces or characters that must be percent-encoded'
  if (raw.includes('\\')) return 'it contains a backslash'
  if (raw.includes('#')) return 'it contains a fragment'
  const match = /^([A-Za-z][A-Za-z0-9+.-]*):\/\/([^/?#]*)([^?#]*)/.exec(raw)
  if (match === null) {
    const scheme = /^([A-Za-z][A-Za-z0-9+.-]*):/.exec(raw)?.[1].toLowerCase() // `mailto:` says so
    return scheme === undefined || scheme === 'http' || scheme === 'https'
      ? 'it is not an absolute URL'
      : 'it must use https or http'
  }
  const [, scheme, authority, path] = match
  const at = authority.lastIndexOf('@')
  const hostAndPort = authority.slice(at + 1)
  const portMatch = /^(\[[^\]]*\]|[^:]*)(?::(\d*))?$/.exec(hostAndPort)
  if (portMatch === null) return 'its host is malformed'
  return {
    raw,
    scheme: scheme.toLowerCase(),
    userinfo: at !== -1,
    host: portMatch[1].toLowerCase(),
    port: portMatch[2] ?? '',
    path,
  }
}

/** The problems §3.2 and §3.3 share, or undefined. */
function commonUrlProblem(parts: UrlParts): string | undefined {
  // MUST have either an https or http scheme
  if (parts.scheme !== 'https' && parts.scheme !== 'http') return 'it must use https or http'
  if (parts.userinfo) return 'it contains a user name or password' // MUST NOT contain a username or password component
  const segments = parts.path.split('/').map((segment) => segment.toLowerCase().replaceAll('%2e', '.'))
  // MUST NOT contain single-dot or double-dot path segments
  if (segments.some((segment) => segment === '.' || segment === '..')) return 'its path contains a . or .. segment'
  if (parts.port !== '' && !(/^\d{1,5}$/.test(parts.port) && Number(parts.port) <= 65535))
    return 'its port is not a number from 0 to 65535'
  if (/%(?![0-9a-f]{2})/i.test(parts.raw)) return 'it holds a % that two hex digits do not follow' // RFC 3986 §2.1
  if (parts.host === '') return 'it has no host'
  if (!isIpAddress(parts.host) && !isDomainName(parts.host)) return 'its host is not a domain name'
  if (!URL.canParse(parts.raw)) return 'it is not a valid URL'
  return undefined
}

/**
 * True for an IPv6 literal, and for every host the URL standard reads as an IPv4 address: one
 * whose last label is a number, decimal or hex (`10.1`, `0xc0a80001` and `1.2.3.0x4` included).
 * @see https://url.spec.whatwg.org/#ends-in-a-number-checker
 */
function isIpAddress(host: string): boolean {
  if (host.startsWith('[')) return true
  const labels = host.replace(/\.$/, '').split('.')
  return /^(\d+|0x[0-9a-f]*)$/i.test(labels[labels.length - 1])
}

/**
 * A host of letters, digits and hyphens. A label that begins `xn--` is an international name in
 * punycode, and must decode (an A-label, RFC 5890 §2.3.2.1), which Node's URL parser no longer
 * checks from Node 24 on: `domainToUnicode` still does, and leaves a label it cannot decode as it
 * was (or, before Node 24, gives '').
 */
function isDomainName(host: string): boolean {
  const labels = host.replace(/\.$/, '').split('.')
  if (!labels.every((label) => /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(label))) return false
  if (!host.includes('xn--')) return true
  const unicode = domainToUnicode(host)
  return unicode !== '' && !unicode.split('.').some((label) => label.startsWith('xn--'))
}

/**
 * Why a string is not a valid client identifier, or undefined when it is one. A URL without a
 * path counts as having the path `/` (§3.4).
 * @see https://indieauth.spec.indieweb.org/#client-identifier IndieAuth §3.3
 */
export function clientIdProblem(raw: string): string | undefined {
  if (raw.length > MAX_URL_LENGTH) return `it is longer than ${MAX_URL_LENGTH} characters`
  const parts = splitHttpUrl(raw)
  if (typeof parts === 'string') return parts
  const problem = commonUrlProblem(parts)
  if (problem !== undefined) return problem
  if (parts.port !== '' && Number(parts.port) === 0) return 'its port is 0, where no app can be served'
  if (isIpAddress(parts.host) && parts.host !== '127.0.0.1' && parts.host !== '[::1]') {
    // MUST NOT be IPv4 or IPv6 addresses except for IPv4 127.0.0.1 or IPv6 [::1]
    return 'its host is an IP address other than 127.0.0.1 or [::1]'
  }
  return undefined
}

/** True when a string is a valid client identifier (IndieAuth §3.3). */
export function isClientId(raw: string): boolean {
  return clientIdProblem(raw) === undefined
}

/**
 * Whether a URL names this machine: a client there is never fetched ("the authorization endpoint
 * MUST NOT fetch" it, IndieAuth §4.2), so it publishes nothing, and its redirect URI must share
 * its scheme, host and port; a native app listens there for its answer over plain http.
 */
function isLoopbackUrl(url: string): boolean {
  const host = new URL(url).hostname
  return host === '127.0.0.1' || host === '[::1]' || host === 'localhost'
}

/**
 * Why a string is not a valid profile URL, or undefined when it is one. It lets through a port
 * and an IP address, which §3.2 forbids, so that Latch can be tried on a laptop: the owner's is
 * warned about at start instead (`configWarnings`).
 * @see https://indieauth.spec.indieweb.org/#user-profile-url IndieAuth §3.2
 */
export function profileUrlProblem(raw: string): string | undefined {
  const parts = splitHttpUrl(raw)
  if (typeof parts === 'string') return parts
  return commonUrlProblem(parts)
}

/**
 * The canonical form of a valid identifier, as the URL standard writes it: lowercase scheme and
 * host, `/` for an empty path (what IndieAuth §3.4 asks), and also no default port and a host in
 * punycode (`https://App.Example:443` is `https://app.example/`).
 * @see https://indieauth.spec.indieweb.org/#url-canonicalization IndieAuth §3.4
 */
export function canonicalizeUrl(raw: string): string {
  return new URL(raw).href
}

/** Compares a sent `client_id` with a stored canonical one, after canonicalizing it (IndieAuth §3.4). */
function isSameClientId(sent: string, stored: string): boolean {
  return sent === stored || (isClientId(sent) && canonicalizeUrl(sent) === stored)
}

/** Schemes that run or show something in the browser itself, or that no app can be handed. */
const UNSAFE_SCHEMES = new Set([
  ...['javascript', 'data', 'vbscript', 'file', 'blob', 'about', 'view-source', 'filesystem'],
  ...['ws', 'wss', 'chrome', 'chrome-extension', 'chrome-untrusted', 'devtools', 'moz-extension'],
  ...['edge', 'opera', 'resource'],
])

/**
 * Why `redirect_uri` may not be used with this client, or undefined when it may. It must be
 * absolute and without a fragment, and either on the same scheme, host and port as
 * `client_id`, or exactly one of the redirect URIs the client publishes (a native app's
 * `com.example.app:/callback`, say). A client whose document is a Client ID Metadata Document
 * gets only what it publishes: the draft leaves out IndieAuth's same-host rule. A published
 * loopback redirect matches on any port, since a desktop app listens where it can (RFC 8252
 * §7.3). `client` is what discovery found, if anything; when it was not looked up, or not in
 * time, for the server's own load, neither rule can be applied, and any redirect_uri is refused.
 * @see https://indieauth.spec.indieweb.org/#redirect-url IndieAuth §4.2.2
 * @see https://www.rfc-editor.org/rfc/rfc8252#section-7.3 RFC 8252 §7.3
 * @see https://datatracker.ietf.org/doc/draft-ietf-oauth-client-id-metadata-document/ the draft
 */
export function redirectUriProblem(
  redirectUri: string,
  clientId: string,
  client: ClientLookup = {},
): string | undefined {
  if (redirectUri.length > MAX_URL_LENGTH) return `redirect_uri is longer than ${MAX_URL_LENGTH} characters`
  if (redirectUri.includes('#')) return 'redirect_uri must not contain a fragment'
  const scheme = /^([a-zA-Z][a-zA-Z0-9+.-]*):/.exec(redirectUri)?.[1].toLowerCase()
  if (
    scheme === undefined ||
    !/^[\x21-\x7e]+$/.test(redirectUri) ||
    redirectUri.includes('\\') ||
    !URL.canParse(redirectUri)
  ) {
    return 'redirect_uri is not an absolute URL'
  }
  if ((scheme === 'http' || scheme === 'https') && !/^https?:\/\//i.test(redirectUri))
    return 'redirect_uri is not an absolute URL'
  if (UNSAFE_SCHEMES.has(scheme)) return `redirect_uri must not use the ${scheme} scheme`
  const redirect = new URL(redirectUri)
  const repeated = RESPONSE_PARAMETERS.filter((name) => redirect.searchParams.has(name))
  if (repeated.length > 0) return `redirect_uri must not carry ${repeated.join(', ')}: the answer adds its own`
  // an OAuth client's answer never crosses a network unencrypted: plain http only to a native
  // app's loopback listener (RFC 9700 §2.6, RFC 8252 §7.3)
  if (client.info?.metadataDocument && scheme === 'http' && !isLoopbackUrl(redirectUri))
    return 'redirect_uri uses http on a host other than this machine: an OAuth client must use https there'
  if (client.info?.redirectUris.some((published) => isSameRedirect(published, redirectUri))) return undefined
  const listed = client.info?.redirectUris ?? []
  const shown = listed.slice(0, 3).join(' , ') // a page to read, not the whole list
  const published = listed.length === 0 ? 'none' : listed.length > 3 ? `${shown} and ${listed.length - 3} more` : shown
  if (client.info?.metadataDocument)
    return `redirect_uri is not one of the redirect_uris of the app's Client ID Metadata Document: ${published}`
  // not looked up, or not in time, for the server's load: the app may have a metadata document
  // that lists fewer, and a stranger who makes Latch busy must not win the same-host rule by it
  if (client.busy === true)
    return "redirect_uri cannot be checked: the app's information could not be fetched just now, try again in a moment"
  const origin = new URL(clientId)
  if (redirect.protocol === origin.protocol && redirect.host === origin.host) return undefined
  const notSameOrigin = 'redirect_uri is not on the scheme, host and port of client_id'
  if (isLoopbackUrl(clientId)) return `${notSameOrigin}, as it must be for a loopback client, which is never fetched`
  if (client.info === undefined) {
    return `${notSameOrigin}, and the app's information could not be fetched to check it`
  }
  return `${notSameOrigin}, nor one of the redirect URIs the client publishes: ${published}`
}

/** What Latch adds to a redirect URI: one it already carries would reach the client twice. */
const RESPONSE_PARAMETERS = ['code', 'state', 'iss', 'error', 'error_description']

/**
 * A published redirect URI and a requested one are the same: equal, or both on the loopback
 * interface with the same scheme, host, path and query, whatever the port (RFC 8252 §7.3).
 */
function isSameRedirect(published: string, requested: string): boolean {
  if (published === requested) return true
  const loopback = /^(https?:\/\/(?:127\.0\.0\.1|\[::1\]|localhost))(?::\d{1,5})?([/?].*)?$/i
  const a = loopback.exec(published)
  const b = loopback.exec(requested)
  return a !== null && b !== null && a[1] === b[1] && (a[2] ?? '') === (b[2] ?? '')
}

// --- Client information ---------------------------------------------------------
// IndieAuth §4.2: a client publishes its name, logo and redirect URIs at its client_id URL, as
// JSON metadata (a Client ID Metadata Document, at an https URL, under the OAuth draft's stricter
// rules) or as a page with an `h-app` and `<link rel="redirect_uri">` elements. This is what Latch
// reads from either; fetching it safely, and caching it, is Part 2's (`findClient`).
// https://indieauth.spec.indieweb.org/#client-information-discovery
// https://datatracker.ietf.org/doc/draft-ietf-oauth-client-id-metadata-document/

/**
 * What a client publishes about itself. `logo` is a `data:` URL, fetched by Latch.
 * `metadataDocument` is true when it came from a Client ID Metadata Document, whose rules are
 * stricter than IndieAuth's.
 */
export type ClientInfo = {
  name?: string
  url?: string
  logo?: string
  redirectUris: string[]
  metadataDocument: boolean
  /** The `client_id` a Client ID Metadata Document names, spelt as it spells it. */
  documentClientId?: string
}

/**
 * What discovery found of a client: its information, or why its Client ID Metadata Document
 * refuses the request, or nothing (it could not be fetched, or is a loopback client); `busy` when
 * it was not tried, or not in time, for the server's own load (see `DiscoveryBusy`).
 */
export type ClientLookup = { info?: ClientInfo; refused?: string; busy?: true }

/** A Client ID Metadata Document that was fetched and breaks a rule of the draft. */
class InvalidClientDocument extends Error {}

type ClientDocument = { clientId?: string; name?: string; url?: string; logoUrl?: string; redirectUris: string[] }

/**
 * Whether a redirect URI a client publishes is a URL and nothing else: no spaces, no invisible
 * characters. The list may be shown on an error page, where a stranger's prose ("this server
 * has moved, sign in at…") must not be; and a URL parser keeps the spaces of
 * `important: sign in at…`, a URL of the scheme `important`.
 */
function isPlainUrl(uri: string): boolean {
  return /^[^\s\p{C}]+$/u.test(uri) && URL.canParse(uri)
}

/**
 * Reads a client metadata document: its `client_id` must be the URL it came from, and its
 * `client_uri` a prefix of it. A Client ID Metadata Document (`metadataDocument`, JSON at an
 * https URL) must also spell the URL as the request does, or canonically (checked by
 * `handleAuthorizationRequest`, with `documentClientId`; its `client_uri`, if not a prefix, is
 * only left unshown), list its `redirect_uris`, and hold no client secret
 * (rules of the OAuth Client ID Metadata Document draft, not of IndieAuth); Latch serves public
 * clients only, so `token_endpoint_auth_method` may only be `none`.
 * Its faults throw `InvalidClientDocument`, which refuses the request.
 * @see https://indieauth.spec.indieweb.org/#client-metadata IndieAuth §4.2.1
 * @see https://datatracker.ietf.org/doc/draft-ietf-oauth-client-id-metadata-document/
 */
export function readClientMetadata(text: string, clientId: string, metadataDocument = false): ClientDocument {
  const fault = (message: string) => (metadataDocument ? new InvalidClientDocument(message) : new Error(message))
  let metadata: Record<string, unknown>
  try {
    metadata = JSON.parse(text) as Record<string, unknown>
  } catch {
    throw fault('its metadata is not valid JSON')
  }
  if (!isObject(metadata)) throw fault('its metadata is not a JSON object')
  const { client_id } = metadata
  // "the client_id property MUST match the URL": the URL, however spelt; a Client ID Metadata
  // Document must spell it as the request does, which the request checks (`documentClientId`)
  if (typeof client_id !== 'string' || !isClientId(client_id) || canonicalizeUrl(client_id) !== clientId)
    throw fault(`its metadata names another client_id: it must be ${clientId}`)
  // a prefix, and of the same origin: "http://paypal.com" begins "http://paypal.com.evil.example/" too
  const clientUri = typeof metadata.client_uri === 'string' ? metadata.client_uri : undefined
  const clientUriIsPrefix =
    clientUri !== undefined &&
    clientId.startsWith(clientUri) &&
    URL.canParse(clientUri) &&
    new URL(clientUri).origin === new URL(clientId).origin
  if (metadata.client_uri !== undefined && !clientUriIsPrefix && !metadataDocument) {
    // "The client_uri MUST be a prefix of the client_id"
    throw fault('its client_uri is not a prefix of its client_id')
  }
  const redirectUris = Array.isArray(metadata.redirect_uris)
    ? metadata.redirect_uris.filter((uri): uri is string => typeof uri === 'string' && isPlainUrl(uri))
    : []
  if (metadataDocument) {
    if (redirectUris.length === 0) throw fault('it lists no redirect_uris')
    if (metadata.client_secret !== undefined || metadata.client_secret_expires_at !== undefined)
      throw fault('it holds a client_secret, which a public document must not')
    const method = metadata.token_endpoint_auth_method
    const named = typeof method === 'string' && /^[\w-]{1,40}$/.test(method) ? ` (${method})` : '' // a name, not prose
    if (method !== undefined && method !== 'none')
      throw fault(`its token_endpoint_auth_method is not none${named}: this server serves public clients only`)
  }
  return {
    clientId: client_id,
    name: typeof metadata.client_name === 'string' ? cleanName(metadata.client_name) : undefined,
    // where the draft does not ask it to be a prefix, one that is not is not shown
    url: clientUriIsPrefix ? resolveUrl(clientUri, clientId) : undefined,
    logoUrl: typeof metadata.logo_uri === 'string' ? resolveUrl(metadata.logo_uri, clientId) : undefined,
    redirectUris,
  }
}

/**
 * Reads an HTML client page: the first `h-app` or `h-x-app` (its name, logo and url) and every
 * `<link rel="redirect_uri">`, resolved against the page's URL.
 * @see https://indieauth.spec.indieweb.org/#client-information-discovery IndieAuth §4.2 (2022: §4.2.1, §4.2.2)
 */
export function readClientPage(html: string, pageUrl: string): ClientDocument {
  const elements = scanHtml(html)
  const redirectUris: string[] = []
  for (const element of elements) {
    if (
      element.name === 'link' &&
      hasToken(element.attributes.rel, 'redirect_uri') &&
      element.attributes.href !== undefined
    ) {
      const resolved = resolveLink(element.attributes.href, pageUrl)
      if (resolved !== undefined && isPlainUrl(resolved)) redirectUris.push(resolved)
    }
  }
  const app = elements.findIndex(
    (element) => hasToken(element.attributes.class, 'h-app') || hasToken(element.attributes.class, 'h-x-app'),
  )
  if (app === -1) return { redirectUris }
  const inside = elements.slice(app + 1, elements[app].end)
  const nameElement = inside.find((element) => hasToken(element.attributes.class, 'p-name'))
  const logoElement = inside.find((element) => hasToken(element.attributes.class, 'u-logo'))
  const logo = logoElement?.attributes.src ?? logoElement?.attributes.href
  const href = inside.find((element) => hasToken(element.attributes.class, 'u-url'))?.attributes.href
  const url = href === undefined ? undefined : resolveLink(href, pageUrl)
  return {
    name: cleanName(elementText(html, nameElement ?? elements[app])),
    // shown as the app's own, so only on the page's origin (the JSON's client_uri must even be a prefix of client_id)
    url:
      url !== undefined && url.length <= MAX_URL_LENGTH && new URL(url).origin === new URL(pageUrl).origin
        ? url
        : undefined,
    logoUrl: logo === undefined ? undefined : resolveLink(logo, pageUrl),
    redirectUris,
  }
}

/** The URLs of one relation in a `Link` header, resolved against the page's URL. */
export function readLinkHeader(header: string, rel: string, base: string): string[] {
  const urls: string[] = []
  for (const link of header.split(/,(?=\s*<)/)) {
    const match = /^\s*<([^>]*)>([^]*)$/.exec(link)
    const rels = match === null ? null : /;\s*rel\s*=\s*(?:"([^"]*)"|([^\s;,]+))/i.exec(match[2])
    const resolved = match === null ? undefined : resolveUrl(match[1], base)
    if (rels !== null && hasToken(rels[1] ?? rels[2], rel) && resolved !== undefined) urls.push(resolved)
  }
  return urls
}

// --- Scopes and lifetimes -------------------------------------------------------
// The scopes the consent page describes, how long a pending request waits, the lifetimes the
// owner may choose, and `endpointUrl`, which builds every URL Latch hands out from `ISSUER`.

/** Words for the scopes people meet most, so the consent page can say what each one allows. */
const SCOPE_DESCRIPTIONS: Record<string, string> = {
  profile: 'See your name, photo and URL',
  email: 'See your email address',
  create: 'Create posts on your site',
  draft: 'Create draft posts only',
  update: 'Edit your posts',
  delete: 'Delete your posts',
  undelete: 'Restore deleted posts',
  media: 'Upload files to your media endpoint',
  read: 'Read your feeds and channels',
  follow: 'Follow and unfollow feeds',
  mute: 'Mute and unmute accounts',
  block: 'Block and unblock accounts',
  channels: 'Manage your channels',
}

const PENDING_TTL_SECONDS = 600
/** The scopes the metadata lists: those the consent page describes. Others may be asked for too. */
const DESCRIBED_SCOPES = Object.keys(SCOPE_DESCRIPTIONS)

/**
 * How long an app's access may last, as the consent page offers it: the grant ends then, and
 * refreshing with it. `ACCESS_TOKEN_TTL` is added if missing. "Until you revoke it" (0) gives
 * tokens of `ACCESS_TOKEN_TTL` that an app may refresh for as long as it uses them.
 */
const LIFETIME_CHOICES: [string, number][] = [
  ['1 day', 86400],
  ['1 week', 604800],
  ['1 month', 2592000],
  ['3 months', 7776000],
  ['1 year', 31536000],
]
const UNTIL_REVOKED = 0

function endpointUrl(config: Config, path: string): string {
  return `${config.issuer}${path}`
}

// --- Metadata -------------------------------------------------------------------
// IndieAuth §4.1.1  https://indieauth.spec.indieweb.org/#indieauth-server-metadata
// RFC 8414 §2      https://www.rfc-editor.org/rfc/rfc8414#section-2

/**
 * Builds the server metadata document; every URL starts with the issuer.
 * @see https://indieauth.spec.indieweb.org/#indieauth-server-metadata IndieAuth §4.1.1
 * @see https://www.rfc-editor.org/rfc/rfc8414#section-2
 */
export function buildMetadata(config: Config): Record<string, unknown> {
  return {
    issuer: config.issuer,
    authorization_endpoint: endpointUrl(config, '/auth'),
    token_endpoint: endpointUrl(config, '/token'),
    // public clients only: without this, RFC 8414 says client_secret_basic
    token_endpoint_auth_methods_supported: ['none'],
    introspection_endpoint: endpointUrl(config, '/introspect'),
    introspection_endpoint_auth_methods_supported: config.introspectionSecret === undefined ? ['none'] : ['Bearer'],
    revocation_endpoint: endpointUrl(config, '/revoke'),
    revocation_endpoint_auth_methods_supported: ['none'],
    userinfo_endpoint: endpointUrl(config, '/userinfo'),
    scopes_supported: DESCRIBED_SCOPES,
    response_types_supported: ['code'],
    response_modes_supported: ['query'],
    grant_types_supported: ['authorization_code', 'refresh_token'],
    code_challenge_methods_supported: ['S256'],
    authorization_response_iss_parameter_supported: true,
    // a client_id may be the URL of its metadata: OAuth's name for IndieAuth's client discovery
    client_id_metadata_document_supported: true,
    service_documentation: endpointUrl(config, '/'),
    ui_locales_supported: ['en'],
  }
}

/**
 * Answers `GET /.well-known/oauth-authorization-server` with the metadata.
 * @see https://www.rfc-editor.org/rfc/rfc8414#section-3 RFC 8414 §3
 */
async function handleMetadataRequest(_req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  sendJson(res, 200, buildMetadata(ctx.config))
}

/**
 * Where RFC 8414 §3.1 puts the metadata of an issuer with a path: the well-known prefix, then the
 * path. For `https://example.com/latch`, `/.well-known/oauth-authorization-server/latch`: a path
 * of the site at the issuer's origin, not of Latch, so that site must answer it (see the README).
 * @see https://www.rfc-editor.org/rfc/rfc8414#section-3.1
 */
export function metadataPath(config: Config): string {
  return `/.well-known/oauth-authorization-server${new URL(config.issuer).pathname.replace(/\/$/, '')}`
}

/**
 * A handler that answers `GET` and `HEAD` with Latch's metadata, and a browser's preflight as
 * Latch's own route does, for the site at the issuer's origin to mount at `metadataPath(config)`
 * when Latch runs under a path.
 */
export function createMetadataHandler(config: Config): (req: IncomingMessage, res: ServerResponse) => void {
  return (req, res) => {
    if (req.method === 'OPTIONS') return writePreflight(res, ['GET', 'HEAD'])
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      closeIfBodyUnread(res)
      res.writeHead(405, { Allow: 'GET, HEAD' })
      res.end()
      return
    }
    ;(res as MarkedResponse)[CORS] = true // any origin may read it (`sendJson` says so: see `CORS`)
    sendJson(res, 200, buildMetadata(config))
  }
}

// --- Authorization endpoint -----------------------------------------------------
// IndieAuth §5.2    https://indieauth.spec.indieweb.org/#authorization-request
// RFC 6749 §4.1.1   https://www.rfc-editor.org/rfc/rfc6749#section-4.1.1
// RFC 7636 §4.3     https://www.rfc-editor.org/rfc/rfc7636#section-4.3

/** `Sec-Purpose: prefetch` (and `prefetch;prerender`), and the older `Purpose` and `X-Moz`. */
const PREFETCH = /\bprefetch\b/i

/**
 * Validates an authorization request and shows the consent page. Until `client_id` and
 * `redirect_uri` are known good, errors are a 400 page; after that, redirects to the client.
 * @see https://indieauth.spec.indieweb.org/#authorization-request IndieAuth §5.2
 */
async function handleAuthorizationRequest(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  // A person starts a sign-in by going to a page. A browser that says this request is for an
  // image, a frame, a script or a script's fetch (another site's `<img src=…/auth>`) is not one:
  // nothing is looked up or kept for it, and it cannot fill the store under the owner's address.
  // (Sec-Fetch-Mode would not do: Node's own fetch sends `cors` on every request.)
  const destination = req.headers['sec-fetch-dest']
  if (destination !== undefined && destination !== 'document')
    throw new OAuthError('invalid_request', 'The sign-in page opens only as a page of its own: go back to the app')
  // Nor is a page fetched ahead of a click that may never come (speculation rules, <link
  // rel=prefetch>): a page on another port could ask for hundreds. Refused, the browser asks
  // again if the person does go there.
  if (PREFETCH.test(`${req.headers['sec-purpose'] ?? ''} ${req.headers.purpose ?? ''} ${req.headers['x-moz'] ?? ''}`))
    throw new OAuthError('invalid_request', 'The sign-in page is not fetched ahead: open it from the app')
  const query = queryOf(req.url ?? '/')
  const clientId = requireParam(query, 'client_id')
  noteClient(res, clientId)
  const clientProblem = clientIdProblem(clientId)
  if (clientProblem !== undefined)
    throw new OAuthError('invalid_request', `client_id is not a valid client identifier: ${clientProblem}`)
  // the client_id of the tokens the owner makes on /apps for scripts (`ISSUER/apps`, see
  // `handleScriptToken`): an app that took it would be listed as one
  if (isSameClientId(clientId, scriptClientId(ctx.config)))
    throw new OAuthError('invalid_request', "client_id names this server's own tokens for scripts, not an app")
  const redirectUri = requireParam(query, 'redirect_uri')
  const client = await findClient(canonicalizeUrl(clientId), req, ctx)
  // The draft compares the two by "simple string comparison", and IndieAuth's JSON metadata at an
  // https URL is read as such a document too: so the document names the client_id as the request
  // spells it, or in its canonical form (IndieAuth §3.4: `https://app.example` is `…example/`).
  const spelt = client.info?.documentClientId
  const misspelt = spelt !== undefined && spelt !== clientId && spelt !== canonicalizeUrl(clientId)
  const refused = misspelt ? `its metadata names another client_id: it must be ${clientId}` : client.refused
  if (refused !== undefined)
    throw new OAuthError('invalid_request', `The app's Client ID Metadata Document cannot be used: ${refused}`)
  const redirectProblem = redirectUriProblem(redirectUri, clientId, client)
  if (redirectProblem !== undefined) throw new OAuthError('invalid_request', redirectProblem)

  // From here on redirect_uri is trusted: report errors by redirecting to it (RFC 6749 §4.1.2.1).
  const state = stateOf(query)
  let request: PendingRequest
  try {
    request = buildPendingRequest(
      query,
      { client_id: canonicalizeUrl(clientId), client_name: client.info?.name, redirect_uri: redirectUri },
      ctx,
    )
  } catch (err) {
    if (!(err instanceof OAuthError)) throw err
    const params = { error: err.error, error_description: err.message, state, iss: ctx.config.issuer }
    const location = buildRedirectUrl(redirectUri, params)
    // longer, it would not pass a proxy's buffer for an answer's headers (nginx's is 4 KiB), and
    // the client would get the proxy's 502: the error is shown here instead
    if (location.length > MAX_REDIRECT_LENGTH) throw err
    noteError(res, err.error)
    return redirect(res, 302, location)
  }
  const visitor = await readVisitor(req, ctx)
  request.csrfHash = hashSecret(visitor.csrf) // the request is answered from this browser only
  const id = createSecret()
  request.openedBy = CONNECTION_LIMITS.groupOf(clientAddress(req, ctx.trustedProxies))
  if (req.method !== 'HEAD') await ctx.store.savePending(hashSecret(id), request, ctx.now())
  const passkeys = !visitor.signedIn && (await offersPasskeys(ctx))
  const page = renderConsentPage(request, {
    id,
    csrf: formToken(visitor),
    config: ctx.config,
    signedIn: visitor.signedIn,
    logo: client.info?.logo,
    clientUri: client.info?.url,
    passkeys,
    now: ctx.now(),
  })
  sendPage(res, 200, page, {
    ...passkeyPageHeaders(ctx.config, passkeys),
    'Set-Cookie': csrfCookie(visitor, ctx.config),
  })
}

/**
 * The `state` to send back on an error redirect, as RFC 6749 §4.1.2.1 asks: even one too long to
 * keep, since a client checks `state` before it reads the error (the redirect within
 * `MAX_REDIRECT_LENGTH`). None when it was sent twice.
 */
function stateOf(query: Params): string | undefined {
  const values = query.get('state')?.filter((value) => value !== '') ?? []
  return values.length === 1 ? values[0] : undefined
}

/**
 * Checks the rest of the request, one rule per line. The client and its `redirect_uri` are known
 * good by now, so the first rule broken is sent back to the client (see the caller).
 */
function buildPendingRequest(
  query: Params,
  client: { client_id: string; client_name: string | undefined; redirect_uri: string },
  ctx: Context,
): PendingRequest {
  for (const [name, values] of query) {
    if (name !== 'resource' && values.filter((value) => value !== '').length > 1)
      throw new OAuthError('invalid_request', `Parameter ${name} was sent more than once`)
  }
  const responseType = getParam(query, 'response_type') ?? 'code' // older clients omit it
  if (responseType !== 'code' && responseType !== 'id')
    throw new OAuthError('unsupported_response_type', 'response_type must be code (or id, for the profile only)')
  // The code goes back in the query (RFC 6749 §4.1.2), the one mode the metadata lists: a client
  // that asked for another (form_post, fragment) would look for it elsewhere, and never find it.
  const responseMode = getParam(query, 'response_mode')
  if (responseMode !== undefined && responseMode !== 'query')
    throw new OAuthError('invalid_request', 'response_mode must be query: the code is sent in the query string')
  const codeChallenge = getParam(query, 'code_challenge')
  if (codeChallenge === undefined)
    throw new OAuthError('invalid_request', 'This server requires PKCE (RFC 7636, S256): code_challenge is missing')
  if (!isCodeChallenge(codeChallenge))
    throw new OAuthError('invalid_request', 'code_challenge must be 43 base64url characters')
  // Absent means `plain` in RFC 7636 §4.3, which Latch never takes. Refusing it would only turn
  // away S256 clients that leave it out, so absent is taken as S256: a plain challenge then fails
  // at the exchange.
  const method = getParam(query, 'code_challenge_method') ?? 'S256'
  if (method !== 'S256') throw new OAuthError('invalid_request', 'code_challenge_method must be S256')
  const state = getParam(query, 'state')
  if (state !== undefined && state.length > MAX_STATE_LENGTH)
    throw new OAuthError('invalid_request', `state is longer than ${MAX_STATE_LENGTH} characters`)
  // the redirect with the code, checked now: once the owner has approved, a proxy would refuse it
  const approved = { code: 'c'.repeat(43), state, iss: ctx.config.issuer } // a code is 43 characters
  if (buildRedirectUrl(client.redirect_uri, approved).length > MAX_REDIRECT_LENGTH)
    throw new OAuthError(
      'invalid_request',
      `redirect_uri and state, escaped, make a redirect longer than ${MAX_REDIRECT_LENGTH} characters`,
    )
  const meHint = getParam(query, 'me')
  if (meHint !== undefined && meHint.length > MAX_URL_LENGTH)
    throw new OAuthError('invalid_request', `me is longer than ${MAX_URL_LENGTH} characters`)
  // `id`: the profile-only request of older clients, which no scope or resource turns into more
  const profileOnly = responseType === 'id'
  const scope = profileOnly ? [] : parseScope(getParam(query, 'scope'))
  if (scope.length > MAX_SCOPES)
    throw new OAuthError('invalid_scope', `The request asks for more than ${MAX_SCOPES} scopes`)
  if (scope.some((one) => one.length > MAX_SCOPE_LENGTH))
    throw new OAuthError('invalid_scope', `A scope is longer than ${MAX_SCOPE_LENGTH} characters`)
  const resource = profileOnly ? [] : readResources(query)
  return {
    ...client,
    redirect_uri: detached(client.redirect_uri),
    state: state === undefined ? undefined : detached(state),
    code_challenge: detached(codeChallenge),
    scope: scope.map(detached),
    resource: resource.map(detached),
    meHint: meHint === undefined ? undefined : detached(meHint),
    csrfHash: '',
    expiresAt: ctx.now() + PENDING_TTL_SECONDS * 1000,
  }
}

// What a pending request may hold: with the 8 KiB request target, these keep the 1,000 pending
// requests a store holds at once to a few megabytes, and the consent page to a few kilobytes.
const MAX_STATE_LENGTH = 1_024
/**
 * The longest redirect back to a client: with its other headers, within the 4 KiB that a proxy
 * such as nginx holds of an answer's headers by default, past which the client would get a 502.
 */
const MAX_REDIRECT_LENGTH = 3_584
const MAX_SCOPES = 50
const MAX_SCOPE_LENGTH = 100
const MAX_RESOURCES = 10

/**
 * The services a request names with `resource` (RFC 8707 §2), without duplicates: each an
 * absolute URI without a fragment, else `invalid_target`. An OAuth client such as an MCP client
 * names the server it wants a token for; an IndieAuth client names none.
 * @see https://www.rfc-editor.org/rfc/rfc8707#section-2
 */
function readResources(params: Params): string[] {
  const sent = params.get('resource')
  if (sent === undefined) return [] // an IndieAuth request
  const resources = [...new Set(sent)].filter((resource) => resource !== '')
  if (resources.length > MAX_RESOURCES)
    throw new OAuthError('invalid_target', `The request names more than ${MAX_RESOURCES} resources`)
  for (const resource of resources) {
    if (
      resource.length > MAX_URL_LENGTH ||
      // RFC 3986's characters only: URL() reads a `\` in an http(s) URL as `/`, so that
      // `https://a.example\@b.example/` is a.example to it, and b.example to a person reading it
      !/^[a-zA-Z][a-zA-Z0-9+.-]*:[\w\-.~:/?[\]@!$&'()*+,;=%]+$/.test(resource) ||
      // and an http(s) URL as it is written with its host: URL() reads http:host and http:///host as http://host/
      (/^https?:/i.test(resource) && !/^https?:\/\/[^/?]/i.test(resource)) ||
      !URL.canParse(resource)
    ) {
      throw new OAuthError(
        'invalid_target',
        "Each resource must be an absolute URI in RFC 3986's characters, without a fragment",
      )
    }
  }
  return resources
}

/** The consent page: who asks, where the browser goes next, what access, and one form. */
function renderConsentPage(
  request: PendingRequest,
  form: {
    id: string
    csrf: string
    config: Config
    signedIn: boolean
    logo?: string
    clientUri?: string
    message?: string
    /** Whether to offer "Approve with a passkey" to an owner not signed in. */
    passkeys: boolean
    /** What the owner chose before a refused sign-in, shown again as they left it; else all, until revoked. */
    chosen?: { scope: string[]; lifetime: number }
    /** The time now, to say how long is left to answer. */
    now: number
  },
): string {
  const { config } = form
  // whole minutes left, rounded down, but at least 1
  const minutesLeft = Math.max(1, Math.floor((request.expiresAt - form.now) / 60_000))
  const redirect = new URL(request.redirect_uri)
  const toApp = redirect.protocol !== 'https:' && redirect.protocol !== 'http:' // a native app's scheme
  const scopes = request.scope
    .map((scope) => {
      const description = Object.hasOwn(SCOPE_DESCRIPTIONS, scope)
        ? SCOPE_DESCRIPTIONS[scope]
        : 'Access that this server does not describe'
      const checked = form.chosen === undefined || form.chosen.scope.includes(scope) ? ' checked' : ''
      const box = `<input type="checkbox" name="scope" value="${escapeHtml(scope)}"${checked}>`
      return `<label>${box} <code>${escapeHtml(scope)}</code> · ${escapeHtml(description)}</label>`
    })
    .join('\n')
  const logo =
    form.logo === undefined ? '' : `<img class="logo" src="${escapeHtml(form.logo)}" alt="" width="48" height="48"> `
  const name = request.client_name === undefined ? '' : `<strong>${isolate(request.client_name)}</strong> at `
  const clientHost = new URL(request.client_id).host
  const about =
    form.clientUri === undefined
      ? ''
      : `<p class="muted">About the app: <a href="${escapeHtml(form.clientUri)}" rel="noreferrer">` +
        `${isolate(form.clientUri)}</a></p>`
  // A custom scheme's "host" (`app://bank.example/cb`) says nothing of where the code goes: to
  // whichever app on the device took the scheme. So the whole URI is shown, and said to be an app's.
  const destination = toApp
    ? `<p class="warning">After you decide, your browser opens <code>${isolate(request.redirect_uri)}</code>, ` +
      'which an app on this device handles: approve only if you expect that.</p>'
    : redirect.host === clientHost
      ? `<p class="muted">After you decide, your browser goes to <code>${isolate(redirect.host)}</code>.</p>`
      : `<p class="warning">After you decide, your browser goes to <code>${isolate(redirect.host)}</code>, ` +
        `not to <code>${isolate(clientHost)}</code>: approve only if you expect that.</p>`
  const open =
    config.passwordHash === undefined
      ? '<p class="warning">This server has no password: anyone who can open this page could approve.</p>'
      : ''
  const services =
    request.resource.length === 0
      ? ''
      : `<p>It asks to use ${request.resource.length === 1 ? 'this service' : 'these services'} as you:</p>\n<ul>` +
        request.resource.map((resource) => `<li><code>${isolate(resource)}</code></li>`).join('') +
        '</ul>\n'
  const fieldset = scopes === '' ? '' : `<fieldset>\n<legend>It also asks to</legend>\n${scopes}\n</fieldset>\n`
  const access =
    scopes === '' && services === ''
      ? '<p>It asks for no access beyond your identity.</p>'
      : `${services}${fieldset}${renderLifetimeChoice(config, form.chosen?.lifetime ?? UNTIL_REVOKED)}`
  const apps = `<a href="${escapeHtml(endpointUrl(config, '/apps'))}">your apps</a>`
  const signedInNote =
    config.passwordHash === undefined
      ? `<p class="muted">See ${apps}.</p>`
      : `<p class="muted">You are signed in. See ${apps}.</p>`
  const approvable = form.signedIn || config.passwordSignIn
  const signInPart = form.signedIn
    ? signedInNote
    : config.passwordSignIn
      ? renderPasswordField(config, form.message)
      : renderPasskeysOnly(form.message, '')
  // it signs in and approves at once, so it says so
  const passkey = form.passkeys ? renderPasskeyButton(config, 'Approve with a passkey', 'sign-in', true) : ''
  const approve = approvable ? '<button class="primary" name="decision" value="approve">Approve</button>\n' : ''
  // Enter in a field or a checkbox sends a form as its first button would: with Approve first, a
  // key pressed for a page elsewhere would approve, a password the browser filled in included.
  // So the first is one that sends nothing (a form's `dialog` method does nothing outside a
  // dialog), hidden but laid out: WebKit passes over a button that is not, to the next. A browser
  // that knows no `dialog` method (before 2022) takes GET, and would put the password in a URL:
  // its action is then a `javascript:` URL, which the pages' policy lets run nothing.
  const noEnter = '<button class="no-enter" formmethod="dialog" formaction="javascript:void 0"></button>\n'
  const expected = request.meHint === undefined ? undefined : shownHint(request.meHint)
  const hint =
    expected !== undefined && expected !== new URL(config.me).host
      ? `<p class="muted">The app expected <code>${isolate(expected)}</code>.</p>`
      : ''
  // a name with a dot may name another site ("accounts.example.com"), where the app is not: the
  // heading then adds the host the app is at, which is where its name came from. Dots that only
  // look like one count too: the ideographic full stop, which a host name may even be written with
  // (IDNA reads it as a dot), and those NFKC folds to one of the two (fullwidth, small, halfwidth)
  const named = request.client_name
  const dotted = named !== undefined && /[.\u3002]/.test(named.normalize('NFKC'))
  const appName =
    named === undefined ? clientHost : dotted && named.toLowerCase() !== clientHost ? `${named} (${clientHost})` : named
  return renderPage(
    `Sign in to ${appName}`,
    `<h1>${logo}Sign in to ${isolate(appName)}</h1>
<p>The app ${name}<code>${isolate(request.client_id)}</code>
wants to know that you are <code>${escapeHtml(config.me)}</code>.</p>
${about}
${hint}
${destination}
${open}
<form method="post" action="${escapeHtml(endpointUrl(config, '/auth/consent'))}">
<input type="hidden" name="request" value="${escapeHtml(form.id)}">
<input type="hidden" name="csrf" value="${escapeHtml(form.csrf)}">
${noEnter}${access}
${signInPart}
<div class="actions">
${approve}${passkey}<button name="decision" value="deny" formnovalidate>Deny</button>
</div>
</form>
<p class="muted">Answer within ${formatPeriod(60 * minutesLeft)}: after that, start again from the app.</p>`,
    form.passkeys ? renderPasskeyScript(config) : '',
  )
}

/**
 * The `me` an app sent, as the consent page shows it: the host of the profile it names, as a URL
 * or as a person types it (`example.com`). The rest is not shown: a link anyone can make with a
 * real app's client_id could put a stranger's words on the owner's page ("this server has moved:
 * sign in at…"), in a path or a user name (`latch-moved.example@evil.example`), or in a host that
 * URLs allow and DNS does not (`moved!sign-in-at(evil.example)`). Nothing is shown of a hint that
 * names a user, or whose host is neither a name of letters, digits and hyphens nor an IP address.
 */
function shownHint(me: string): string | undefined {
  const typed = me.trim()
  const url = /^https?:\/\//i.test(typed) ? typed : `https://${typed}`
  if (!URL.canParse(url)) return undefined
  const { hostname, port, username, password } = new URL(url)
  const name = hostname.replace(/\.$/, '')
  const dnsName = name.length <= 253 && DNS_NAME.test(name)
  if ((!dnsName && isIP(unbracketed(name)) === 0) || username !== '' || password !== '') return undefined
  return port === '' ? name : `${name}:${port}`
}

/** A host name as DNS has them: labels of letters, digits and hyphens, of at most 63 characters. */
const DNS_NAME = /^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$/

/**
 * How long the app's access lasts: a fixed time, because many clients never refresh and some
 * should not keep access, or until the owner revokes it, for apps that refresh.
 */
function renderLifetimeChoice(config: Config, selected: number): string {
  const options = lifetimeChoices(config)
    .map(
      ([label, seconds]) =>
        `<option value="${seconds}"${seconds === selected ? ' selected' : ''}>${escapeHtml(label)}</option>`,
    )
    .join('')
  return `<p><label>Its access lasts <select name="lifetime">${options}</select></label></p>`
}

function lifetimeChoices(config: Config): [string, number][] {
  const ttl = config.accessTokenTtlSeconds
  const revoked: [string, number] = ['until you revoke it', UNTIL_REVOKED]
  if (LIFETIME_CHOICES.some(([, seconds]) => seconds === ttl)) return [...LIFETIME_CHOICES, revoked]
  return [...[...LIFETIME_CHOICES, [formatPeriod(ttl), ttl] as [string, number]].sort((a, b) => a[1] - b[1]), revoked]
}

/**
 * The lifetime chosen on the consent page: one of those offered, in seconds, or `UNTIL_REVOKED`,
 * which is also what a form that sends none gets.
 */
function readLifetime(value: string | undefined, config: Config): number {
  if (value === undefined) return UNTIL_REVOKED
  const choice = lifetimeChoices(config).find(([, seconds]) => String(seconds) === value)
  if (choice === undefined) throw new OAuthError('invalid_request', 'Choose one of the offered token lifetimes')
  return choice[1]
}

// --- Consent --------------------------------------------------------------------
// IndieAuth §5.2.1  https://indieauth.spec.indieweb.org/#authorization-response
// RFC 6749 §4.1.2   https://www.rfc-editor.org/rfc/rfc6749#section-4.1.2

/**
 * Handles the consent form: checks the pending request, the CSRF token and, unless the owner is
 * signed in, the password or a passkey; then redirects to the client with a code or with
 * `access_denied`. Two checks tie the form to the owner's browser: its token (`requireFormToken`)
 * proves that one of Latch's pages sent it; the CSRF cookie set when the request was opened
 * proves that this browser opened it, so that the owner cannot be led to approve a request that
 * someone else opened, whose code would go to that someone's session at the app. A button
 * pressed twice gets the first press's answer (`rememberAnswer`).
 * @see https://indieauth.spec.indieweb.org/#authorization-response IndieAuth §5.2.1
 * @see https://www.rfc-editor.org/rfc/rfc9207#section-2 RFC 9207 (iss)
 */
async function handleConsent(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const id = requireParam(form, 'request')
  const idHash = hashSecret(id)
  const request = (await ctx.store.findPending(idHash, ctx.now())) ?? answeredLately(idHash, ctx)?.request
  if (request === undefined)
    throw new OAuthError('invalid_request', 'This sign-in request is unknown or has expired: start again from the app')
  noteClient(res, request.client_id)
  const visitor = await requireFormToken(form, req, ctx, { signsIn: signsIn(form) })
  if (!readCsrfCookies(req, ctx.config).some((cookie) => safeEqual(hashSecret(cookie), request.csrfHash))) {
    throw new OAuthError(
      'access_denied',
      'This sign-in request was opened in another browser: start again from the app',
      {
        event: `a consent for ${request.client_id} was sent from another browser than the one that opened it`,
      },
    )
  }
  const decision = getParam(form, 'decision')
  if (decision !== 'approve' && decision !== 'deny') throw new OAuthError('invalid_request', 'Choose Approve or Deny')
  const lifetime = readLifetime(getParam(form, 'lifetime'), ctx.config)
  const granted = request.scope.filter((scope) => (form.get('scope') ?? []).includes(scope))
  const headers: Record<string, string> = {}
  if (decision === 'approve' && !visitor.signedIn) {
    const refused = await checkSignIn(form, { visitor, request: idHash }, req, res, ctx)
    if (refused !== undefined) {
      const info = ctx.clients.get(request.client_id)?.info
      const passkeys = await offersPasskeys(ctx)
      return sendPage(
        res,
        refused.status,
        renderConsentPage(request, {
          id,
          csrf: formToken(visitor),
          config: ctx.config,
          signedIn: false,
          logo: info?.logo,
          clientUri: info?.url,
          message: refused.message,
          passkeys,
          chosen: { scope: granted, lifetime },
          now: ctx.now(),
        }),
        { ...passkeyPageHeaders(ctx.config, passkeys), ...refused.headers },
      )
    }
    headers['Set-Cookie'] = await startSession(ctx)
    await endSessionsNamed(req, ctx) // a page opened before another tab signed in: as at any sign-in
  }
  const taken = (await ctx.store.takePending(idHash, ctx.now())) !== undefined
  // a second press is answered as the first was: with what the first chose, whatever its own form says
  const answer = taken ? { request, decision, granted, lifetime } : answeredLately(idHash, ctx)
  if (answer?.decision !== decision) {
    // answered otherwise, or pushed out while the password was checked: a right password still signs in
    throw new OAuthError(
      'invalid_request',
      'This sign-in request was answered already, or has expired meanwhile: start again from the app',
      { headers },
    )
  }
  if (taken) rememberAnswer(idHash, answer, ctx)
  const iss = ctx.config.issuer
  if (decision === 'deny') {
    noteError(res, 'access_denied')
    const params = {
      error: 'access_denied',
      error_description: 'The owner denied the request',
      state: request.state,
      iss,
    }
    return redirect(res, 303, buildRedirectUrl(request.redirect_uri, params))
  }
  const chosen = { scope: answer.granted, resource: request.resource, lifetime: answer.lifetime }
  const code = await issueCode(request, chosen, ctx).catch(async (err: unknown) => {
    // not stored (a full disk): the request is open again, to be answered once there is room; if
    // even that is not stored, its answer stays remembered, and a press within the minute issues the code
    if (taken) await ctx.store.savePending(idHash, request, ctx.now()).then(() => ctx.answered.delete(idHash))
    throw err
  })
  redirect(res, 303, buildRedirectUrl(request.redirect_uri, { code, state: request.state, iss }), headers)
}

/** Issues a code bound to the request, the granted scopes and the chosen lifetime, and returns its value. */
async function issueCode(
  request: PendingRequest,
  chosen: { scope: string[]; resource: string[]; lifetime: number },
  ctx: Context,
): Promise<string> {
  const code = createSecret()
  const now = ctx.now()
  await ctx.store.saveCode(
    hashSecret(code),
    {
      client_id: request.client_id,
      client_name: request.client_name,
      redirect_uri: request.redirect_uri,
      code_challenge: request.code_challenge,
      scope: chosen.scope,
      resource: chosen.resource,
      me: ctx.config.me,
      accessTokenTtlSeconds: chosen.lifetime === UNTIL_REVOKED ? ctx.config.accessTokenTtlSeconds : chosen.lifetime,
      approvedForSeconds: chosen.lifetime === UNTIL_REVOKED ? undefined : chosen.lifetime,
      issuedAt: now,
      expiresAt: now + ctx.config.codeTtlSeconds * 1000,
      usedAt: undefined,
    },
    now,
  )
  return code
}

/**
 * A button pressed twice (a double click) sends the form twice, and the browser shows the answer
 * to the second press, for a request the first one took: an error page, and the app never got its
 * code. So an answered request is remembered for ANSWER_REPEAT_SECONDS, and the same decision sent
 * again from the same browser is answered as the first was: the same redirect for Deny, another
 * code for Approve, with the scopes and lifetime the first press chose. The first code is still
 * single-use; the app redeems the one its browser brings.
 */
function rememberAnswer(idHash: string, answer: Answer, ctx: Context): void {
  // full: one of the address that answered the most goes, so that a stranger's answers push out their own
  if (ctx.answered.size >= MAX_ANSWERS_REMEMBERED)
    ctx.answered.delete(oldestOfBusiest(ctx.answered, ({ request }) => request.openedBy) ?? '')
  ctx.answered.set(idHash, { ...answer, until: ctx.steadyNow() + ANSWER_REPEAT_SECONDS * 1000 })
}

/** An answer to a consent page: the request, the decision, and what the owner chose with it. */
type Answer = { request: PendingRequest; decision: string; granted: string[]; lifetime: number }

function answeredLately(idHash: string, ctx: Context): Answer | undefined {
  const answer = ctx.answered.get(idHash)
  return answer !== undefined && answer.until > ctx.steadyNow() ? answer : undefined
}

/** The first key, in the map's order, of the group that holds the most entries: a walk to count, one to find it. */
function oldestOfBusiest<V>(map: Map<string, V>, groupOf: (value: V) => string | undefined): string | undefined {
  const counts = new Map<string | undefined, number>()
  let busiest: string | undefined
  let most = 0
  for (const value of map.values()) {
    const group = groupOf(value)
    const count = (counts.get(group) ?? 0) + 1
    counts.set(group, count)
    if (count > most) [busiest, most] = [group, count]
  }
  for (const [key, value] of map) if (groupOf(value) === busiest) return key
  return undefined
}

const ANSWER_REPEAT_SECONDS = 60
const MAX_ANSWERS_REMEMBERED = 100

// --- Code redemption ------------------------------------------------------------
// IndieAuth §5.3    https://indieauth.spec.indieweb.org/#redeeming-the-authorization-code
// RFC 6749 §4.1.3   https://www.rfc-editor.org/rfc/rfc6749#section-4.1.3
// RFC 7636 §4.6     https://www.rfc-editor.org/rfc/rfc7636#section-4.6
//
// The life of a code, from the consent to its redemption, at `POST /auth` or `POST /token`:
//  1. `issueCode` (Consent): 32 random bytes, stored under their hash with the client_id,
//     redirect_uri, code_challenge, scope and me it is bound to; it lives CODE_TTL.
//  2. `checkCode`: the code is found, used or not (`store.findCodeUsedOrNot`); client_id and
//     redirect_uri must match it (IndieAuth §5.3.1), and `verifyCodeChallenge` checks the PKCE
//     verifier against the challenge (RFC 7636 §4.6). A failed check uses nothing up. IndieAuth
//     lists client_id and redirect_uri in both requests; `POST /token` requires them (but takes
//     an OAuth request's code, one issued with `resource`, without redirect_uri, as OAuth 2.1
//     §10.2 allows), while `POST /auth` checks them only when sent, for clients that redeem with
//     the code and verifier alone. The verifier binds the code to the client that started the
//     flow anyway.
//  3. `POST /auth`: `store.markCodeUsed`; `POST /token`: `issueTokens` calls
//     `store.redeemForTokens`, which marks it used in the same write as the grant and the
//     tokens. Either is true for the first caller only.
//  4. A replay is caught there: the code was used before. The grant made from it, whose id is the
//     code's hash, is revoked with every token issued from it (`revokeReplayedCode`,
//     RFC 6749 §4.1.2), and the request gets `invalid_grant`.

/**
 * Redeems a code for the owner's profile URL only: `{"me": "…"}`, with the profile information
 * when the `profile` scope was granted.
 * @see https://indieauth.spec.indieweb.org/#profile-url-response IndieAuth §5.3.2
 */
async function handleProfileRedemption(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  readPublicClient(req, form, ctx.config)
  noteClient(res, getParam(form, 'client_id'))
  const grantType = getParam(form, 'grant_type')
  if (grantType !== undefined && grantType !== 'authorization_code') {
    throw new OAuthError('unsupported_grant_type', 'grant_type must be authorization_code')
  }
  const { code, codeHash } = await checkCode(form, { clientRequired: false }, ctx)
  await consumeCode(codeHash, code.client_id, ctx)
  // JSON leaves out a profile that is undefined
  sendJson(res, 200, { me: code.me, profile: buildProfile(code.scope, ctx.config.profile) })
}

/**
 * Finds a code and checks that the request matches it: `client_id`, `redirect_uri` and the PKCE
 * verifier. Shared by `POST /auth` and `POST /token`. The code is not consumed here.
 * @see https://indieauth.spec.indieweb.org/#redeeming-the-authorization-code IndieAuth §5.3.1
 * @see https://www.rfc-editor.org/rfc/rfc7636#section-4.6
 */
async function checkCode(form: Params, options: { clientRequired: boolean }, ctx: Context) {
  const value = requireParam(form, 'code')
  const clientId = options.clientRequired ? requireParam(form, 'client_id') : getParam(form, 'client_id')
  const redirectUri = getParam(form, 'redirect_uri')
  const verifier = requireParam(form, 'code_verifier')
  if (!isCodeVerifier(verifier))
    throw new OAuthError('invalid_request', 'code_verifier must be 43 to 128 characters of A-Z, a-z, 0-9 and -._~')
  const codeHash = hashSecret(value)
  const code = await ctx.store.findCodeUsedOrNot(codeHash, ctx.now())
  if (code === undefined) throw new OAuthError('invalid_grant', 'The authorization code is unknown or has expired')
  // IndieAuth's token request names the redirect_uri; OAuth 2.1's need not (its §10.2), since the
  // verifier binds the code already: an OAuth request's code (one with `resource`) is taken without
  if (redirectUri === undefined && options.clientRequired && code.resource.length === 0)
    throw new OAuthError('invalid_request', 'Parameter redirect_uri is missing')
  if (clientId !== undefined && !isSameClientId(clientId, code.client_id)) {
    throw new OAuthError('invalid_grant', 'client_id does not match the client the code was issued to')
  }
  if (redirectUri !== undefined && redirectUri !== code.redirect_uri) {
    throw new OAuthError('invalid_grant', 'redirect_uri does not match the one in the authorization request')
  }
  if (!verifyCodeChallenge(verifier, code.code_challenge)) {
    // the verifier as the challenge: PKCE's `plain`, its method left out (see `buildPendingRequest`)
    if (safeEqual(verifier, code.code_challenge))
      throw new OAuthError('invalid_grant', 'code_challenge_method plain is not supported: send S256 (RFC 7636)')
    throw new OAuthError('invalid_grant', 'PKCE check failed: code_verifier does not match code_challenge')
  }
  return { code, codeHash }
}

/** Whether what a redemption spent is gone (a code), or its grant is (a refresh token), rather than used. */
async function revokedMeanwhile(redeemed: TokenIssue['redeemed'], grantId: string, ctx: Context): Promise<boolean> {
  const now = ctx.now()
  if (redeemed.kind === 'code') return (await ctx.store.findCodeUsedOrNot(redeemed.hash, now)) === undefined
  return (await ctx.store.findGrant(grantId, now)) === undefined
}

/** Marks a checked code used, or, when it was used before, revokes what was issued from it. */
async function consumeCode(codeHash: string, clientId: string, ctx: Context): Promise<void> {
  if (!(await ctx.store.markCodeUsed(codeHash, ctx.now()))) await revokeReplayedCode(codeHash, clientId, ctx)
}

/**
 * A code that was used before is a replay: the grant made from it, and so every token issued
 * from it, is revoked, because "the authorization server MUST deny the request and SHOULD
 * revoke (when possible) all tokens previously issued based on that authorization code".
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-4.1.2
 */
async function revokeReplayedCode(codeHash: string, clientId: string, ctx: Context): Promise<never> {
  await ctx.store.revokeGrant(codeHash, ctx.now()) // a grant's id is the hash of its code
  throw new OAuthError(
    'invalid_grant',
    'The authorization code was already used, so the tokens issued from it are revoked',
    {
      event: `a code issued to ${clientId} was redeemed again, so its grant and every token issued from it are revoked`,
    },
  )
}

/**
 * The profile object for a scope: `name`, `url` and `photo` with `profile`, and `email` only
 * when `email` was granted too; undefined without `profile`.
 * @see https://indieauth.spec.indieweb.org/#profile-information IndieAuth §5.3.4
 */
export function buildProfile(scope: string[], profile: Profile): Record<string, string> | undefined {
  if (!scope.includes('profile')) return undefined
  const info: Record<string, string> = {}
  if (profile.name !== undefined) info.name = profile.name
  info.url = profile.url
  if (profile.photo !== undefined) info.photo = profile.photo
  if (profile.email !== undefined && scope.includes('email')) info.email = profile.email
  return info
}

// --- Token endpoint -------------------------------------------------------------
// IndieAuth §5.3.3  https://indieauth.spec.indieweb.org/#access-token-response
// IndieAuth §5.5    https://indieauth.spec.indieweb.org/#refresh-tokens
// RFC 6749 §5.1, §6 https://www.rfc-editor.org/rfc/rfc6749#section-6

/**
 * Exchanges a code, or a refresh token, for an access token and a new refresh token. Older
 * clients also revoke here, with `action=revoke`.
 * @see https://indieauth.spec.indieweb.org/#access-token-response IndieAuth §5.3.3
 * @see https://indieauth.spec.indieweb.org/#refresh-tokens IndieAuth §5.5
 */
async function handleTokenRequest(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  readPublicClient(req, form, ctx.config)
  if (getParam(form, 'action') !== undefined) return handleLegacyRevocation(form, res, ctx)
  noteClient(res, getParam(form, 'client_id'))
  const grantType = requireParam(form, 'grant_type')
  switch (grantType) {
    case 'authorization_code':
      return sendJson(res, 200, await exchangeCode(form, ctx))
    case 'refresh_token':
      return sendJson(res, 200, await refreshGrant(form, ctx))
    default:
      throw new OAuthError('unsupported_grant_type', 'grant_type must be authorization_code or refresh_token')
  }
}

/**
 * Latch's clients are public: they prove nothing but the code's PKCE verifier, so the metadata
 * says `none`. Some OAuth libraries still send the `client_id` as the HTTP Basic user name with
 * an empty password (RFC 6749 §2.3.1); that is read as if it came in the body. A password would
 * be a client secret, which Latch never issued: 401 `invalid_client`, as for a secret or a signed
 * assertion in the body, so that an app set up as a confidential client learns it is not one.
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-2.3.1
 */
function readPublicClient(req: IncomingMessage, form: Params, config: Config): void {
  if (getParam(form, 'client_secret') !== undefined || getParam(form, 'client_assertion') !== undefined)
    throw basicRefused('This server issues no client secrets: send the client_id alone', config)
  if (req.headers.authorization === undefined) return // the usual case
  // no ` *` after the credentials: node:http trims a header's trailing spaces already, and with
  // it, a run of spaces before a wrong character took time growing with its square
  const match = /^Basic +([A-Za-z0-9+/]*={0,2})$/i.exec(req.headers.authorization)
  if (match === null) {
    if (/^Basic\b/i.test(req.headers.authorization)) throw basicRefused('The Basic credentials are malformed', config)
    return
  }
  // a byte a character, as a body is read: the client_id's UTF-8 is decoded with its escapes, once
  const credentials = Buffer.from(match[1], 'base64').toString('latin1')
  // the last colon: a client_id should be form-encoded, but many libraries send a URL as it is
  const colon = credentials.lastIndexOf(':')
  if (colon === -1) throw basicRefused('The Basic credentials are malformed', config)
  if (colon !== credentials.length - 1)
    throw basicRefused('This server issues no client secrets: send the client_id with an empty password', config)
  let clientId: string
  try {
    clientId = decodeFormComponent(credentials.slice(0, colon))
  } catch {
    throw basicRefused('The Basic credentials are malformed: the client_id in them is not form-encoded', config)
  }
  const sent = getParam(form, 'client_id')
  if (sent !== undefined && sent !== clientId)
    throw new OAuthError('invalid_request', 'The client_id in the body is not the one in the Authorization header')
  form.set('client_id', [clientId])
}

function basicRefused(description: string, config: Config): OAuthError {
  return new OAuthError('invalid_client', description, {
    headers: { 'WWW-Authenticate': `Basic realm="${config.issuer}"` },
  })
}

/**
 * Redeems a code with scope, or for a resource: the owner's approval becomes a grant, with its
 * first tokens. A code with neither only proves identity (IndieAuth §5.3.3). A code for a
 * resource is OAuth's: an MCP client may ask for no scope at all, and the token it gets carries
 * none, only its audience.
 */
async function exchangeCode(form: Params, ctx: Context) {
  const { code, codeHash } = await checkCode(form, { clientRequired: true }, ctx)
  if (code.scope.length === 0 && code.resource.length === 0) {
    throw new OAuthError(
      'invalid_grant',
      'This code was issued without scope, so it only proves identity: redeem it at the authorization endpoint instead',
    )
  }
  const grant = {
    client_id: code.client_id,
    client_name: code.client_name,
    me: code.me,
    scope: code.scope,
    resource: code.resource,
    accessTokenTtlSeconds: code.accessTokenTtlSeconds,
    approvedAt: code.issuedAt,
    lastUsedAt: 0,
    endsAt: code.approvedForSeconds === undefined ? undefined : code.issuedAt + code.approvedForSeconds * 1000,
    expiresAt: 0,
  }
  const access = { scope: code.scope, resource: narrowResource(form, code.resource) }
  return await issueTokens({ kind: 'code', hash: codeHash }, codeHash, grant, access, ctx)
}

/**
 * Rotates a refresh token: the old one stops working, and presenting it again revokes the
 * whole grant, since one of the two presenters must have stolen it. RFC 9700 §4.14.2 asks this
 * of a server whose clients are public, as Latch's are (they hold no secret to prove who they
 * are). Within `REFRESH_TOKEN_GRACE` of its rotation, though, a token the client has not gone on
 * from is a retry (the answer was lost on the way, or the client refreshed twice at once) and
 * gets fresh tokens too: the FAPI 2.0 Security Profile (§5.3.2.1), written for confidential
 * clients and against rotation, asks that much of any server that rotates. Once the client has
 * used what the rotation gave, the old token is a reuse (see `MemoryStore.redeem`).
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-6
 * @see https://www.rfc-editor.org/rfc/rfc9700#section-4.14.2 RFC 9700 §4.14.2
 */
async function refreshGrant(form: Params, ctx: Context) {
  const hash = hashSecret(requireParam(form, 'refresh_token'))
  const clientId = requireParam(form, 'client_id')
  const found = await findLiveToken(hash, 'refresh', ctx)
  const now = ctx.now()
  // issued (at its last use) for the REFRESH_TOKEN_TTL of then: a shorter one, set since, ends it
  // too, counted from the end of the second it was issued in (the store may keep whole seconds)
  if (found === undefined || found.token.issuedAt + 1000 + ctx.config.refreshTokenTtlSeconds * 1000 <= now)
    throw new OAuthError('invalid_grant', 'The refresh token is unknown, expired or revoked')
  const graceMs = ctx.config.refreshTokenGraceSeconds * 1000
  const retriedSince = now - graceMs
  const { usedAt } = found.token
  // A retry comes within the grace period of the rotation; `usedAt` is kept in whole seconds,
  // rounded down, hence the 1000. A `usedAt` further ahead than the grace means the clock was set
  // back since: a reuse, else the set-back would hold the grace open.
  const retry = graceMs > 0 && usedAt !== undefined && usedAt + 1000 > retriedSince && usedAt <= now + graceMs
  if (usedAt !== undefined && !retry) {
    await revokeReusedRefreshToken(found.token.grantId, found.grant.client_id, ctx) // whatever else the request says
  }
  if (!isSameClientId(clientId, found.grant.client_id)) {
    throw new OAuthError('invalid_grant', 'client_id does not match the client the refresh token was issued to')
  }
  // a refresh token is issued with its grant's scope and resources, which the grant keeps; a
  // snapshot may write a used one without them
  const access = {
    scope: narrowScope(getParam(form, 'scope'), found.grant.scope),
    resource: narrowResource(form, found.grant.resource),
  }
  const day = countRefresh(found.token.grantId, found.grant.client_id, ctx)
  const redeemed = {
    kind: 'refresh',
    hash,
    retriedSince: graceMs > 0 ? retriedSince : undefined,
  } as const
  try {
    return await issueTokens(redeemed, found.token.grantId, found.grant, access, ctx)
  } catch (err) {
    day.count-- // nothing was stored (a full disk, a race lost): not a refresh
    throw err
  }
}

/**
 * Each refresh keeps two more tokens until they expire (the used refresh token, to recognise its
 * reuse), so a client refreshing without pause would grow the store without end. A grant may be
 * refreshed MAX_REFRESHES_A_DAY times in a day: a client whose access tokens last five minutes
 * needs 288. Past that, 429 until the day is over; the refresh token is not used up.
 */
function countRefresh(grantId: string, clientId: string, ctx: Context): { count: number } {
  const now = ctx.steadyNow()
  let day = ctx.refreshes.get(grantId)
  if (day === undefined || day.since + DAY_MS <= now) {
    ctx.refreshes.delete(grantId)
    if (ctx.refreshes.size >= MAX_REFRESHING_GRANTS) ctx.refreshes.delete(ctx.refreshes.keys().next().value ?? '')
    day = { since: now, count: 0 }
    ctx.refreshes.set(grantId, day)
  }
  if (++day.count > MAX_REFRESHES_A_DAY) {
    const first = day.count === MAX_REFRESHES_A_DAY + 1 // said once a day in the log, not at every refusal
    throw new OAuthError('slow_down', `This grant was refreshed ${MAX_REFRESHES_A_DAY} times within a day: wait`, {
      status: 429,
      headers: { 'Retry-After': String(Math.ceil((day.since + DAY_MS - now) / 1000)) },
      event: first
        ? `${clientId} refreshed a grant ${MAX_REFRESHES_A_DAY} times in a day: refused until the day is over`
        : undefined,
    })
  }
  return day
}

const MAX_REFRESHES_A_DAY = 1_000
const DAY_MS = 86_400_000
/** The grants whose refreshes are counted at once; past it, the one whose day began longest ago is forgotten. */
const MAX_REFRESHING_GRANTS = 10_000

async function revokeReusedRefreshToken(grantId: string, clientId: string, ctx: Context): Promise<never> {
  await ctx.store.revokeGrant(grantId, ctx.now())
  throw new OAuthError('invalid_grant', 'The refresh token was already used, so every token of its grant is revoked', {
    event: `a refresh token of ${clientId} was used again, so its grant and every token of it are revoked`,
  })
}

/** A refresh may ask for fewer scopes than were granted, never more (RFC 6749 §6). */
function narrowScope(requested: string | undefined, granted: string[]): string[] {
  if (requested === undefined) return granted
  const scope = parseScope(requested)
  if (scope.length === 0 || scope.some((one) => !granted.includes(one))) {
    throw new OAuthError('invalid_scope', 'A refresh may narrow the granted scope, never widen it')
  }
  return scope
}

/**
 * The audience of the access token: the resources the request names, each one the owner
 * approved, or all of those when it names none. So a refresh may narrow the audience, never
 * widen it, and a refresh token keeps the whole grant's.
 * @see https://www.rfc-editor.org/rfc/rfc8707#section-2.2 RFC 8707 §2.2
 */
function narrowResource(form: Params, granted: string[]): string[] {
  const requested = readResources(form)
  if (requested.length === 0) return granted
  if (requested.some((resource) => !granted.some((one) => sameResource(one, resource)))) {
    throw new OAuthError('invalid_target', 'The resource was not among those the owner approved for this app')
  }
  return granted.filter((one) => requested.some((resource) => sameResource(one, resource))) // as approved
}

/**
 * Redeems a code or a refresh token for an access token for `access` (scope and audience) and a
 * refresh token for the whole grant, and saves the grant with its new expiry: all in one store
 * write. Redeemed twice, by a replay or a race, the grant is revoked.
 */
async function issueTokens(
  redeemed: TokenIssue['redeemed'],
  grantId: string,
  grant: Grant,
  { scope, resource }: Pick<Token, 'scope' | 'resource'>,
  ctx: Context,
) {
  const now = ctx.now()
  // nothing outlives the approval: the last tokens end when it does. With under a second of it
  // left none are issued: their expires_in, rounded down, would be 0
  const endsAt = grant.endsAt ?? Infinity
  if (endsAt - now < 1000) throw new OAuthError('invalid_grant', 'The access the owner approved for this app has ended')
  // approved "until you revoke it": ACCESS_TOKEN_TTL as set now if shorter, so that it applies to every app
  // (not if longer: a grant of an older version may hold a shorter lifetime that the owner chose)
  const ttl =
    grant.endsAt === undefined
      ? Math.min(grant.accessTokenTtlSeconds, ctx.config.accessTokenTtlSeconds)
      : grant.accessTokenTtlSeconds
  const accessTokenExpiresAt = Math.min(now + ttl * 1000, endsAt)
  const accessToken = createSecret()
  const refreshToken = createSecret()
  const access: Token = {
    kind: 'access',
    grantId,
    scope,
    resource,
    issuedAt: now,
    expiresAt: accessTokenExpiresAt,
    usedAt: undefined,
  }
  const refresh: Token = {
    kind: 'refresh',
    grantId,
    scope: grant.scope,
    resource: grant.resource,
    issuedAt: now,
    expiresAt: Math.min(now + ctx.config.refreshTokenTtlSeconds * 1000, endsAt),
    usedAt: undefined,
  }
  // the caller's own copy, made for this request: updated in place, not copied again
  grant.lastUsedAt = now
  if (redeemed.kind === 'refresh') grant.lastRotated = redeemed.hash
  grant.expiresAt = Math.max(grant.expiresAt, access.expiresAt, refresh.expiresAt)
  const tokens: TokenIssue['tokens'] = [
    [hashSecret(accessToken), access],
    [hashSecret(refreshToken), refresh],
  ]
  if (!(await ctx.store.redeemForTokens({ redeemed, grantId, grant, tokens }, now))) {
    // revoked (or expired) since the checks, by the owner's "revoke all" or the app's revocation:
    // nothing was replayed, and there is nothing left to revoke
    if (await revokedMeanwhile(redeemed, grantId, ctx))
      throw new OAuthError(
        'invalid_grant',
        `The ${redeemed.kind === 'code' ? 'code' : 'refresh token'} was revoked, or has expired`,
      )
    await (redeemed.kind === 'code'
      ? revokeReplayedCode(grantId, grant.client_id, ctx)
      : revokeReusedRefreshToken(grantId, grant.client_id, ctx))
  }
  return {
    access_token: accessToken,
    token_type: 'Bearer',
    // always, "" for none: RFC 6749 §5.1 requires it when the owner narrowed what was asked for,
    // down to none; §3.3 has no empty scope, but "" is the one way to say none that clients read
    scope: scope.join(' '),
    me: grant.me,
    // down: a token cut short by the approval's end would else be said to outlive it by a part of a second
    expires_in: Math.floor((accessTokenExpiresAt - now) / 1000),
    refresh_token: refreshToken,
    profile: buildProfile(scope, ctx.config.profile), // left out of the JSON when undefined: without the profile scope
  }
}

/** A live token of the given kind with its live grant, or undefined. */
async function findLiveToken(
  hash: string,
  kind: Token['kind'],
  { store, now: clock }: Pick<Context, 'store' | 'now'>,
): Promise<{ token: Token; grant: Grant } | undefined> {
  const now = clock()
  const token = await store.findToken(hash, now)
  if (token === undefined || token.kind !== kind) return undefined
  const grant = await store.findGrant(token.grantId, now)
  return grant === undefined ? undefined : { token, grant }
}

// --- Introspection --------------------------------------------------------------
// IndieAuth §6   https://indieauth.spec.indieweb.org/#access-token-verification
// RFC 7662 §2    https://www.rfc-editor.org/rfc/rfc7662#section-2

/**
 * Tells a resource server whether an access token is live, and for whom. Anything else, a
 * refresh token, a malformed or an unknown token, gets exactly `{"active": false}`.
 * @see https://indieauth.spec.indieweb.org/#access-token-verification-response IndieAuth §6.2
 * @see https://www.rfc-editor.org/rfc/rfc7662#section-2.2
 */
async function handleIntrospectionRequest(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  requireIntrospectionCaller(req, ctx.config)
  const form = await readForm(req)
  const hash = hashSecret(requireParam(form, 'token'))
  const caller = getParam(form, 'resource')
  const found = await findLiveToken(hash, 'access', ctx)
  // RFC 7662 §4: active only to a caller the token may be used at (see `isForResource`)
  if (found === undefined || !isForResource(found.token, caller)) return sendJson(res, 200, { active: false })
  const { token, grant } = found
  noteClient(res, grant.client_id)
  await noteUse(ctx.store, token.grantId, ctx.now())
  sendJson(res, 200, describeToken(token, grant))
}

/**
 * What introspection says of a live access token, to a resource server it is for. `aud` names the
 * services it is for (RFC 8707), one as a string, several as a list, as in a JWT: the one that asked
 * is among them, and may check so itself. An IndieAuth token has no audience; a token without scope
 * has "" as its scope, in which no scope is found.
 * @see https://www.rfc-editor.org/rfc/rfc7662#section-2.2
 */
function describeToken(token: Token, grant: Grant): Record<string, unknown> {
  return {
    active: true,
    me: grant.me,
    scope: token.scope.join(' '),
    client_id: grant.client_id,
    aud: token.resource.length === 0 ? undefined : token.resource.length === 1 ? token.resource[0] : token.resource,
    exp: Math.floor(token.expiresAt / 1000),
    iat: Math.floor(token.issuedAt / 1000),
  }
}

/**
 * With `INTROSPECTION_SECRET` set, the caller must send it as a Bearer credential. IndieAuth §6.1
 * says "The endpoint MUST also require some form of authorization to access this endpoint"; Latch
 * leaves it open when no secret is set, so that a resource server on the same box works without
 * one. Then anyone may introspect: a token must be known to be asked about, and it cannot be
 * guessed. Set the secret to follow §6.1.
 * @see https://www.rfc-editor.org/rfc/rfc6750#section-3
 */
function requireIntrospectionCaller(req: IncomingMessage, config: Config): void {
  if (config.introspectionSecret === undefined) return
  // the wire contract: whoever did not send it as a Bearer credential (none, another scheme, a
  // malformed header) gets 401 `invalid_token`; the challenge, as RFC 6750 §3.1 asks, names no error
  let credential: string | undefined
  try {
    credential = bearerCredential(req, config)
  } catch (err) {
    if (!(err instanceof OAuthError)) throw err // a malformed Bearer header: not sent, here
  }
  if (credential === undefined) {
    throw new OAuthError('invalid_token', 'This endpoint needs the introspection secret as a Bearer credential', {
      headers: { 'WWW-Authenticate': bearerChallenge(config) },
    })
  }
  if (!safeEqual(credential, config.introspectionSecret)) {
    throw new OAuthError('invalid_token', 'The Bearer credential is not the introspection secret', {
      headers: { 'WWW-Authenticate': bearerChallenge(config, 'invalid_token') },
    })
  }
}

// --- Revocation -----------------------------------------------------------------
// IndieAuth §7   https://indieauth.spec.indieweb.org/#token-revocation
// RFC 7009 §2    https://www.rfc-editor.org/rfc/rfc7009#section-2

/**
 * Revokes a token. Answers 200 whether or not the token was known, as RFC 7009 §2.2 requires.
 * @see https://www.rfc-editor.org/rfc/rfc7009#section-2.2
 */
async function handleRevocationRequest(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  readPublicClient(req, form, ctx.config)
  noteClient(res, getParam(form, 'client_id'))
  await revokeToken(requireParam(form, 'token'), getParam(form, 'client_id'), ctx)
  sendEmptyOk(res)
}

/**
 * The revocation IndieAuth clients made before today's revocation endpoint (§7): `POST /token`
 * with `action=revoke`, as IndieAuth of November 2020 had it (its §7.1).
 * @see https://indieauth.spec.indieweb.org/20201126/#token-revocation-request IndieAuth (2020) §7.1
 */
async function handleLegacyRevocation(form: Params, res: ServerResponse, ctx: Context): Promise<void> {
  if (getParam(form, 'action') !== 'revoke') throw new OAuthError('invalid_request', 'action must be revoke')
  await revokeToken(requireParam(form, 'token'), getParam(form, 'client_id'), ctx)
  sendEmptyOk(res)
}

/**
 * Revokes an access token alone, or a refresh token with its whole grant: "If the particular
 * token is a refresh token [...] the authorization server SHOULD also invalidate all access
 * tokens based on the same authorization grant". A client that names itself may revoke only
 * its own tokens: "verifies whether the token was issued to the client making the revocation
 * request". When it was not, the RFC refuses with an error; Latch answers the same 200 as for a
 * token it does not know, and revokes nothing. A public client's `client_id` proves nothing, so
 * an error would only tell whoever sent it that the token is live. IndieAuth clients send no
 * `client_id` here.
 * @see https://www.rfc-editor.org/rfc/rfc7009#section-2.1
 */
async function revokeToken(value: string, clientId: string | undefined, ctx: Context): Promise<void> {
  const hash = hashSecret(value)
  const token = await ctx.store.findToken(hash, ctx.now())
  if (token === undefined) return // unknown or expired: anyone may send one, and it costs no write
  // a token whose grant was revoked is dead already: revoking it again, as often as its holder
  // likes, costs no write either
  const grant = await ctx.store.findGrant(token.grantId, ctx.now())
  if (grant === undefined) return
  if (clientId !== undefined && !isSameClientId(clientId, grant.client_id)) return
  // one write either way, so that a failed one revokes nothing: a refresh token dies with its
  // grant, and so does a token for scripts, its grant's one token (else /apps would list it for years)
  if (token.kind === 'refresh' || grant.client_id === scriptClientId(ctx.config))
    await ctx.store.revokeGrant(token.grantId, ctx.now())
  else await ctx.store.deleteToken(hash)
}

// --- Bearer endpoints -----------------------------------------------------------
// IndieAuth §9   https://indieauth.spec.indieweb.org/#user-information
// RFC 6750 §2, §3  https://www.rfc-editor.org/rfc/rfc6750#section-3

/**
 * Answers the profile information of the owner to a token with the `profile` scope, with the
 * owner's `me` as `sub`, which IndieAuth does not ask for but OpenID Connect libraries require.
 * @see https://indieauth.spec.indieweb.org/#user-information IndieAuth §9
 * @see https://www.rfc-editor.org/rfc/rfc6750#section-3.1
 */
async function handleUserinfoRequest(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  // a token may come in a form body (RFC 6750 §2.2); a body of another type holds none, and is not read
  let form: Params | undefined
  try {
    form = req.method === 'POST' && mediaTypeOf(req) === FORM_TYPE ? await readForm(req) : undefined
  } catch (err) {
    // RFC 6750 §3: every refusal of a request for a protected resource carries a challenge
    if (err instanceof OAuthError) err.headers['WWW-Authenticate'] = bearerChallenge(ctx.config, err.error)
    throw err
  }
  const { token, grant } = await requireAccessToken(req, form, ctx, endpointUrl(ctx.config, '/userinfo'))
  if (!token.scope.includes('profile')) {
    throw new OAuthError('insufficient_scope', 'The access token was not granted the profile scope', {
      headers: { 'WWW-Authenticate': `${bearerChallenge(ctx.config, 'insufficient_scope')}, scope="profile"` },
    })
  }
  // `sub`: what OpenID Connect libraries require
  sendJson(res, 200, { sub: grant.me, ...buildProfile(token.scope, ctx.config.profile) })
}

/**
 * The token verification of IndieAuth before §6, still used by Micropub servers: `GET /token`
 * with `Authorization: Bearer` answers `{me, client_id, scope}`. Its answer has no room for an
 * audience, so a token bound to services is refused here: the resource server asking cannot say
 * which it is, and one that got a token meant for another service could use it (RFC 8707 §2).
 * @see https://indieauth.spec.indieweb.org/20201126/#access-token-verification IndieAuth (2020) §6.1
 */
async function handleTokenVerification(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const { token, grant } = await requireAccessToken(req, undefined, ctx, undefined)
  const answer = { me: grant.me, client_id: grant.client_id, scope: token.scope.join(' ') }
  // the token endpoints of the indieauth.com era answered a form, and scripts written for them ask
  // for one, or send the Content-Type of a form on their GET (the Micropub script copied from site
  // to site, with curl's `*/*`): those get a form, unless they name JSON, as JSON readers do
  const accept = (req.headers.accept ?? '').toLowerCase()
  if ((accept.includes(FORM_TYPE) || mediaTypeOf(req) === FORM_TYPE) && !accept.includes('json')) {
    const body = new URLSearchParams(answer).toString()
    const headers = { 'Content-Type': 'application/x-www-form-urlencoded', 'Content-Length': body.length, ...NO_STORE }
    return writeAnswer(res, 200, withCors(res, headers), body)
  }
  sendJson(res, 200, answer)
}

/**
 * The live access token a request carries, in the `Authorization` header or an `access_token`
 * form field, or 401 with a `WWW-Authenticate` challenge; both at once is 400. A token
 * bound to services (`resource`, RFC 8707) is for them alone: Latch's endpoint takes it only if
 * it names `endpoint`, the endpoint's own URL.
 * @see https://www.rfc-editor.org/rfc/rfc6750#section-2
 */
async function requireAccessToken(
  req: IncomingMessage,
  form: Params | undefined,
  ctx: Context,
  endpoint: string | undefined,
) {
  const refused = (error: string, description: string) =>
    new OAuthError(error, description, { headers: { 'WWW-Authenticate': bearerChallenge(ctx.config, error) } })
  const header = bearerCredential(req, ctx.config)
  const sent = form?.get('access_token')?.filter((value) => value !== '') ?? []
  if (sent.length > 1) throw refused('invalid_request', 'Parameter access_token was sent more than once')
  const field = sent[0]
  // one way only, even for the same token twice: RFC 6750 §3.1 names this invalid_request
  if (header !== undefined && field !== undefined)
    throw refused('invalid_request', 'Send the access token one way: in the Authorization header or in the body')
  const value = header ?? field
  if (value === undefined)
    throw credentialsMissing('Send an access token as Authorization: Bearer', bearerChallenge(ctx.config))
  const found = await findLiveToken(hashSecret(value), 'access', ctx)
  if (found === undefined) throw refused('invalid_token', 'The access token is unknown, expired or revoked')
  const { resource } = found.token
  if (resource.length > 0 && (endpoint === undefined || !resource.some((one) => sameResource(one, endpoint))))
    throw refused('invalid_token', 'The access token is for another service (its audience), not this one')
  await noteUse(ctx.store, found.token.grantId, ctx.now())
  return found
}

/**
 * The credential of an `Authorization: Bearer` header, or undefined when there is none (or
 * another scheme). A Bearer header that is not one token is 400 `invalid_request` (RFC 6750 §3.1).
 */
function bearerCredential(req: IncomingMessage, config: Config): string | undefined {
  const authorization = req.headers.authorization ?? ''
  const credential = /^Bearer +(\S+) *$/i.exec(authorization)?.[1]
  if (credential === undefined && /^Bearer\b/i.test(authorization)) {
    throw new OAuthError('invalid_request', 'The Authorization header must be Bearer, a space and one token', {
      headers: { 'WWW-Authenticate': bearerChallenge(config, 'invalid_request') },
    })
  }
  return credential
}

/** The `WWW-Authenticate` challenge of Latch's Bearer endpoints, with an error code when there is one. */
function bearerChallenge(config: Config, error?: string): string {
  return error === undefined ? `Bearer realm="${config.issuer}"` : `Bearer realm="${config.issuer}", error="${error}"`
}

/**
 * A 401 for a request that sent no credentials: a challenge, and no error code, since nothing
 * was wrong with a token it did not send (RFC 6750 §3.1).
 * @see https://www.rfc-editor.org/rfc/rfc6750#section-3.1
 */
function credentialsMissing(description: string, challenge: string): OAuthError {
  return new OAuthError(NO_ERROR_CODE, description, { status: 401, headers: { 'WWW-Authenticate': challenge } })
}

/** What `checkAccessToken` says of a token: what it allows, or why it must be refused. */
export type AccessCheck =
  | { active: true; me: string; client_id: string; scope: string[]; aud: string[]; expiresAt: number }
  | { active: false; error: 'invalid_token' | 'insufficient_scope'; description: string }

/**
 * Checks an access token for a resource server that runs in the same process as Latch and shares
 * its store: the token must be live, carry every scope of `scope`, and be meant for this server
 * (its audience, RFC 8707). A server that gives a `resource` takes only tokens that name it, as an
 * MCP server must check; one that gives none takes only tokens bound to none, as IndieAuth's are.
 * A resource server elsewhere asks `POST /introspect` the same (see the README). Answer
 * `invalid_token` with 401 and `insufficient_scope` with 403, each with a `WWW-Authenticate:
 * Bearer` challenge (RFC 6750 §3). It rejects when the store does (a full disk, a database away):
 * answer 500 then, as `POST /introspect` does.
 * @see https://www.rfc-editor.org/rfc/rfc6750#section-3.1
 */
export async function checkAccessToken(
  store: Store,
  token: string,
  want: { resource?: string; scope?: string[] } = {},
  now: () => number = Date.now,
): Promise<AccessCheck> {
  const found = await findLiveToken(hashSecret(token), 'access', { store, now })
  if (found === undefined)
    return { active: false, error: 'invalid_token', description: 'The access token is unknown, expired or revoked' }
  const { resource, scope } = found.token
  if (!isForResource(found.token, want.resource))
    return { active: false, error: 'invalid_token', description: 'The access token was not issued for this resource' }
  const missing = (want.scope ?? []).filter((one) => !scope.includes(one))
  if (missing.length > 0)
    return { active: false, error: 'insufficient_scope', description: `The access token lacks ${missing.join(' ')}` }
  await noteUse(store, found.token.grantId, now())
  const { me, client_id } = found.grant
  return { active: true, me, client_id, scope, aud: resource, expiresAt: found.token.expiresAt }
}

/**
 * Whether a token may be used at the resource server that names itself `resource`, or none. A
 * token bound to services (RFC 8707) is theirs alone: a server that names none, as IndieAuth's
 * (a Micropub endpoint) do, is not one of them, else an MCP server the owner connected could post
 * to the owner's site with the token an app gave it. A token with no audience, an IndieAuth one,
 * is for servers that name none.
 */
function isForResource(token: Pick<Token, 'resource'>, resource: string | undefined): boolean {
  return resource === undefined
    ? token.resource.length === 0
    : token.resource.some((one) => sameResource(one, resource))
}

/**
 * Whether two resource indicators name the same service (RFC 8707 leaves the comparison to the
 * server): the same origin, compared as URLs, so that `HTTPS://HOST:443` is `https://host`, and
 * the same path and query as written, an empty path being `/`: `https://host` is `https://host/`,
 * which is what an MCP client sends for a server at its origin. The path is not resolved as URLs
 * do (`/a/%2e%2e/b` is `/b` to them): the consent page shows it as written, and the owner approves
 * what the page shows.
 */
function sameResource(a: string, b: string): boolean {
  if (a === b) return true
  if (!URL.canParse(a) || !URL.canParse(b)) return false
  const [one, other] = [new URL(a), new URL(b)]
  if (one.origin === 'null' || one.origin !== other.origin) return false
  return one.username === other.username && one.password === other.password && pathAsWritten(a) === pathAsWritten(b)
}

/** What follows a URL's authority as it is written, an empty path as `/`. */
function pathAsWritten(url: string): string {
  const rest = /^[a-z][a-z0-9+.-]*:\/\/[^/?#]*(.*)$/is.exec(url)?.[1] ?? url
  return rest.startsWith('/') ? rest : `/${rest}`
}

/**
 * Notes that a token of a grant was used, for the apps page. Only a hint (`Store.touchGrant`):
 * a store that could not keep it (`NotStored`, a full disk) has said so in the log, and the token
 * still works. Any other failure is a fault of the store, and goes on up.
 */
function noteUse(store: Store, grantId: string, now: number): Promise<void> {
  return store.touchGrant(grantId, now).catch((err: unknown) => {
    if (!(err instanceof NotStored)) throw err
  })
}

// --- Home page ------------------------------------------------------------------
// IndieAuth §4.1: what the owner pastes into their site so that clients find this server.

/**
 * Says what this server is, and shows the owner the `<link>` tags to paste into their site:
 * `indieauth-metadata`, and the two older relations that clients before 2022 look for. The same
 * links go out as a `Link` header, so a `ME` that points at this server is discoverable too; and
 * when `ME` is on this server's origin (the default), in the page's own `<head>`, for clients
 * that read only HTML.
 * @see https://indieauth.spec.indieweb.org/#discovery-by-clients IndieAuth §4.1
 */
async function handleHomePage(_req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const { config } = ctx
  const relations: [string, string][] = [
    ['indieauth-metadata', endpointUrl(config, '/.well-known/oauth-authorization-server')],
    ['authorization_endpoint', endpointUrl(config, '/auth')],
    ['token_endpoint', endpointUrl(config, '/token')],
  ]
  const metadata = endpointUrl(config, '/.well-known/oauth-authorization-server')
  const links = relations.map(([rel, href]) => `<link rel="${rel}" href="${escapeHtml(href)}">`).join('\n')
  const linkHeader = relations.map(([rel, href]) => `<${href}>; rel="${rel}"`).join(', ')
  const head = new URL(config.me).origin === new URL(config.issuer).origin ? links : ''
  sendPage(
    res,
    200,
    renderPage(
      'Latch',
      `<h1>Latch</h1>
<p>This is the IndieAuth server of <code>${escapeHtml(config.me)}</code>.
Apps that let you sign in with your website send you here to confirm that you are you.</p>
<p>To use it, paste these lines into the <code>&lt;head&gt;</code> of <code>${escapeHtml(config.me)}</code>:</p>
<pre>${escapeHtml(links)}</pre>
<p><a href="${escapeHtml(endpointUrl(config, '/apps'))}">Your connected apps</a></p>
<p class="muted">Server metadata: <a href="${escapeHtml(metadata)}">${escapeHtml(metadata)}</a></p>`,
      head,
    ),
    { Link: linkHeader },
  )
}

// --- Router ---------------------------------------------------------------------
// The route table, and `createHandler`: the checks it makes before any handler (the number of
// header lines, the Host, a proxy, the request target), and the one catch that renders errors.

type Handler = (req: IncomingMessage, res: ServerResponse, ctx: Context) => Promise<void>

/**
 * One row of the route table: a path, the methods one handler answers there, whether its errors
 * are shown to a person (a page) or to a program (JSON), whether browser apps on any origin may
 * call it (CORS: RFC 9700 §2.6 allows it on these endpoints, never on the authorization request
 * or the consent form, which are for the owner's own browser), and the spec that defines it.
 */
type Route = { path: string; methods: string[]; handler: Handler; errors: 'page' | 'json'; cors: boolean; spec: string }

/**
 * Every endpoint of Latch, in the order a client meets them. The router reads nothing else, and
 * the README's table of endpoints is this one (a test holds the two together). Every `GET` row
 * lists `HEAD` too (RFC 9110 §9.3.2; a new one must): node:http then sends the headers without
 * the body. The spec column is for the reader and the README; the router does not read it.
 */
// prettier-ignore
const ROUTES: Route[] = [
  route('/.well-known/oauth-authorization-server', 'GET HEAD', handleMetadataRequest, 'json', 'CORS', 'RFC 8414 §3'),
  route('/auth',                'GET HEAD', handleAuthorizationRequest, 'page', '',     'IndieAuth §5.2'),
  route('/auth/consent',        'POST',     handleConsent,              'page', '',     'IndieAuth §5.2.1'),
  route('/auth',                'POST',     handleProfileRedemption,    'json', 'CORS', 'IndieAuth §5.3.2'),
  route('/token',               'POST',     handleTokenRequest,         'json', 'CORS', 'IndieAuth §5.3.3, §5.5'),
  route('/introspect',          'POST',     handleIntrospectionRequest, 'json', 'CORS', 'IndieAuth §6, RFC 7662'),
  route('/revoke',              'POST',     handleRevocationRequest,    'json', 'CORS', 'IndieAuth §7, RFC 7009'),
  route('/userinfo',            'GET HEAD POST', handleUserinfoRequest, 'json', 'CORS', 'IndieAuth §9, RFC 6750'),
  route('/token',               'GET HEAD', handleTokenVerification,    'json', 'CORS', 'IndieAuth before §6'),
  route('/apps',                'GET HEAD', handleAppsPage,             'page', '',     ''),
  route('/apps/revoke',         'POST',     handleAppRevocation,        'page', '',     ''),
  route('/apps/revoke-all',     'POST',     handleAllAppsRevocation,    'page', '',     ''),
  route('/apps/tokens',         'POST',     handleScriptToken,          'page', '',     ''),
  route('/sign-in',             'POST',     handleSignIn,               'page', '',     ''),
  route('/sign-out',            'POST',     handleSignOut,              'page', '',     ''),
  route('/sign-out-everywhere', 'POST',     handleSignOutEverywhere,    'page', '',     ''),
  route('/passkeys/challenge',  'POST',     handlePasskeyChallenge,     'json', '',     'WebAuthn §5.4, §5.5'),
  route('/passkeys/add',        'POST',     handlePasskeyAddition,      'page', '',     'WebAuthn §7.1'),
  route('/passkeys/remove',     'POST',     handlePasskeyRemoval,       'page', '',     ''),
  route('/passkey.js',          'GET HEAD', handlePasskeyScript,        'page', '',     ''),
  route('/',                    'GET HEAD', handleHomePage,             'page', '',     'IndieAuth §4.1'),
]

/** A row of the table, from its columns. */
function route(
  path: string,
  methods: string,
  handler: Handler,
  errors: Route['errors'],
  cors: string,
  spec: string,
): Route {
  return { path, methods: methods.split(' '), handler, errors, cors: cors === 'CORS', spec }
}

/** The route table by path, then by method. */
const ROUTES_BY_PATH = new Map<string, Map<string, Route>>()
for (const row of ROUTES) {
  const methods = ROUTES_BY_PATH.get(row.path) ?? new Map<string, Route>()
  for (const method of row.methods) methods.set(method, row)
  ROUTES_BY_PATH.set(row.path, methods)
}

/** Picks the route for a method and path: 404 for an unknown path, 405 for another method. */
function selectRoute(method: string, path: string): Pick<Route, 'handler' | 'errors' | 'cors'> {
  const methods = ROUTES_BY_PATH.get(path)
  if (methods === undefined) return { handler: rejectUnknownPath, errors: 'json', cors: false }
  const found = methods.get(method)
  if (found !== undefined) return found
  const corsMethods = [...methods].filter(([, row]) => row.cors).map(([name]) => name)
  if (method === 'OPTIONS' && corsMethods.length > 0) {
    return { handler: async (_req, res) => writePreflight(res, corsMethods.sort()), errors: 'json', cors: true }
  }
  const allow = [...methods.keys()].sort().join(', ')
  const rejectMethod = async () => {
    throw new OAuthError('method_not_allowed', `This endpoint accepts ${allow} only`, { headers: { Allow: allow } })
  }
  return { handler: rejectMethod, errors: 'json', cors: corsMethods.length > 0 } // a browser app may read why
}

/**
 * Answers a CORS preflight: any origin may send these methods with `Authorization`, and with
 * `MCP-Protocol-Version`, which MCP clients (the TypeScript SDK's, for one) send when they fetch
 * the metadata; refused, it costs a browser client a second fetch without it.
 * @see https://fetch.spec.whatwg.org/#http-cors-protocol
 */
function writePreflight(res: ServerResponse, methods: string[]): void {
  closeIfBodyUnread(res)
  res.writeHead(204, {
    'Access-Control-Allow-Origin': '*',
    'Access-Control-Allow-Methods': methods.join(', '),
    'Access-Control-Allow-Headers': 'Authorization, Content-Type, MCP-Protocol-Version',
    'Access-Control-Max-Age': '86400',
    ...NO_STORE, // as every answer of /token, /auth and /introspect is
  })
  res.end()
}

async function rejectUnknownPath(req: IncomingMessage, _res: ServerResponse, ctx: Context): Promise<void> {
  // Latch's own path under ISSUER's path: the proxy in front, or the app it is mounted in, left it on
  const mount = mountPath(ctx.config)
  const path = pathOf(req.url ?? '/')
  if (
    mount !== '' &&
    (path === mount || path.startsWith(`${mount}/`)) &&
    ROUTES_BY_PATH.has(path.slice(mount.length) || '/')
  )
    throw new OAuthError(
      'not_found',
      `There is no endpoint at this path: it begins with the path of ISSUER, ${mount}, which must be taken off ` +
        'before Latch sees the request (by the proxy in front, or the app it is mounted in); Latch answers at its root',
    )
  throw new OAuthError('not_found', 'There is no endpoint at this path')
}

/**
 * Creates the request handler: a plain `(req, res) => void` for node:http, Express or Connect.
 * It logs one line per request (method, path, status, milliseconds) and never a secret.
 */
export function createHandler(options: HandlerOptions): (req: IncomingMessage, res: ServerResponse) => void {
  // `openStore` not awaited: else every request that reads the store would answer 500
  if (typeof (options.store as { then?: unknown } | undefined)?.then === 'function')
    throw new TypeError('createHandler: store is a Promise: pass await openStore(config)')
  // else the config names a file that is never written, and a restart loses everything without a word
  if (options.store === undefined && options.config.dataFile !== 'memory')
    throw new TypeError(
      `createHandler: DATA_FILE is ${options.config.dataFile}, but no store was given: ` +
        'pass store: await openStore(config), or set DATA_FILE to memory',
    )
  // else every URL it names (metadata, forms, redirects) has a port no client can reach
  if (new URL(options.config.issuer).port === '0')
    throw new TypeError(
      `createHandler: ISSUER is ${options.config.issuer}: with PORT 0, pass the port bound to loadConfig ` +
        '(its boundPort), or set ISSUER',
    )
  const log = neverThrowing(options.log ?? console.log)
  const now = options.now ?? Date.now
  const store = options.store ?? new MemoryStore({ log })
  const kept = keptFor(store, options.config, now)
  const ctx: Context = {
    config: options.config,
    store,
    now,
    log,
    clientFetch: options.clientFetch ?? {},
    trustedProxies: trustedProxiesOf(options.config),
    ...kept.shared,
  }
  if ((store instanceof MemoryStore || store instanceof FileStore) && options.signal?.aborted !== true)
    keepSweeping(kept, store, options.signal)
  const ownHosts = ownHostsOf(ctx.config)
  // the issuer's host and port, when on loopback: a page asked for under another loopback name is sent there
  const issuerUrl = new URL(ctx.config.issuer)
  const loopbackIssuerHost = LOOPBACK_HOSTS.has(unbracketed(issuerUrl.hostname)) ? issuerUrl.host : undefined
  const mountedAt = mountPath(ctx.config)
  let lastOwnHost: string | undefined // the Host header that passed last time: nearly every request repeats it
  const proxyWarning = kept.proxyWarning
  return (req, res) => {
    if (req.socket.destroyed) return // a connection closed already (see `MAX_QUEUED_ANSWERS`): no one to answer
    const started = process.hrtime.bigint() // not `performance`: its first use loads perf_hooks, on the first request
    if (req.url !== undefined && req.url[0] !== '/') takeAbsoluteForm(req)
    const path = pathOf(req.url ?? '/')
    const { handler, errors, cors } = selectRoute(req.method ?? 'GET', path)
    if (cors) (res as MarkedResponse)[CORS] = true
    // the address now: once the connection is gone, node:http no longer knows it
    const address = clientAddress(req, ctx.trustedProxies)
    if (proxyWarning.pending && req.headers['x-forwarded-for'] !== undefined && isLoopbackPeer(req)) {
      const peer = plainAddress(req.socket.remoteAddress ?? '')
      // the last proxy on loopback seen named is not looked up again
      if (peer !== proxyWarning.named && ctx.trustedProxies !== undefined && isTrustedProxy(peer, ctx.trustedProxies))
        proxyWarning.named = peer
      if (peer !== proxyWarning.named) {
        proxyWarning.pending = false
        logEvent(
          ctx,
          'warning',
          'requests come through a proxy on this machine (X-Forwarded-For) that TRUST_PROXY does not name: ' +
            "every client is logged, and counted for password tries, under the proxy's address; " +
            'add 127.0.0.1,::1 to TRUST_PROXY',
        )
      }
    }
    const logged = describePath(path, handler, mountedAt)
    res.on('close', () => {
      try {
        logRequest(req, res, { address, path: logged, started }, ctx)
      } catch (err) {
        // an embedding app's `log` that throws, or a clock no date can be made of: a lost line, not
        // an uncaught exception that ends the process
        console.error(`latch: a request could not be logged: ${String(err)}`)
      }
    })
    const host = req.headers.host
    const own = ownHosts === undefined || (host !== undefined && (host === lastOwnHost || isOwnHost(host, ownHosts)))
    if (own) lastOwnHost = host
    const refused = refusalOf(req, own, ctx.config.passwordHash === undefined)
    if (refused === undefined && loopbackIssuerHost !== undefined && host !== loopbackIssuerHost && errors === 'page') {
      const there = issuerAliasUrl(req, loopbackIssuerHost, ctx.config)
      if (there !== undefined) return redirect(res, 307, there)
    }
    const checked = refused === undefined ? handler(req, res, ctx) : Promise.reject(refused)
    checked.catch((err: unknown) => renderError(err, req, res, errors === 'page', ctx))
  }
}

/**
 * Where to send a page asked for under another loopback name of this machine than `ISSUER`'s,
 * on its port: `http://127.0.0.1:3000/auth?…` for an issuer of `http://localhost:3000`. The page
 * would show, but its forms post to the issuer, where the browser holds other cookies, and they
 * would be refused (and a passkey works only under the issuer's name). Behind a proxy the Host
 * header may name anything, so only an issuer on loopback (`loopbackIssuerHost`) is checked at all.
 */
function issuerAliasUrl(req: IncomingMessage, loopbackIssuerHost: string, config: Config): string | undefined {
  if (req.method !== 'GET' && req.method !== 'HEAD') return undefined
  const [, name, port] = /^(.*?)(:\d*)?$/.exec((req.headers.host ?? '').toLowerCase()) ?? []
  const [, issuerName, issuerPort] = /^(.*?)(:\d*)?$/.exec(loopbackIssuerHost) ?? []
  if (name === issuerName || port !== issuerPort || !LOOPBACK_HOSTS.has(unbracketed(name))) return undefined
  return endpointUrl(config, req.url ?? '/')
}

/**
 * Whether a request says it came through a proxy: a header a proxy adds (nginx's `proxy_params`,
 * Caddy, CDNs), or HTTP/1.0, which nginx speaks to the server behind it by default and no
 * browser speaks at all.
 */
function cameThroughProxy(req: IncomingMessage): boolean {
  const { headers } = req
  if (req.httpVersion === '1.0' || PROXY_HEADERS.some((name) => headers[name] !== undefined)) return true
  for (const name in headers) if (name.startsWith('x-forwarded-')) return true
  return false
}

const PROXY_HEADERS = ['forwarded', 'via', 'x-real-ip', 'x-client-ip', 'cf-connecting-ip', 'true-client-ip']

/** Why a request is refused before any handler reads it, or undefined. */
function refusalOf(req: IncomingMessage, own: boolean, passwordless: boolean): OAuthError | undefined {
  if (req.rawHeaders.length > 2 * MAX_HEADER_LINES) {
    return new OAuthError('invalid_request', `The request has more than ${MAX_HEADER_LINES} header lines`, {
      status: 431,
    })
  }
  if (!own) {
    return new OAuthError(
      'invalid_request',
      'This server answers only to its own host name: set ISSUER to the URL you use, or set PASSWORD_HASH',
      { status: 421 },
    )
  }
  if (passwordless && !isLocalPeer(req)) {
    return new OAuthError(
      'access_denied',
      'This server has no password, so it answers only to this machine: set PASSWORD_HASH',
    )
  }
  // A proxy on this machine connects from loopback for whoever it serves, under a Host header
  // it may set to ISSUER's. Most say so; one that says nothing cannot be told from a browser.
  if (passwordless && cameThroughProxy(req)) {
    return new OAuthError(
      'access_denied',
      'This server has no password, and this request came through a proxy, so it may be anyone: set PASSWORD_HASH',
    )
  }
  if (hasSeveralHosts(req)) return new OAuthError('invalid_request', 'The request has more than one Host header')
  if ((req.url ?? '').length > MAX_REQUEST_TARGET) {
    return new OAuthError('invalid_request', `The request URL is longer than ${MAX_REQUEST_TARGET} characters`, {
      status: 414,
    })
  }
  return undefined
}

/**
 * A request target in absolute form, `POST http://host/token`, which "a server MUST accept" though
 * clients send it only to proxies: the path and query are routed as if sent alone, untouched,
 * and the authority stands for the Host header ("MUST ignore the received Host header field").
 * Any other target (`*`, or no scheme) is left as it came, and finds no route.
 * @see https://www.rfc-editor.org/rfc/rfc9112#section-3.2.2 RFC 9112 §3.2.2
 */
function takeAbsoluteForm(req: IncomingMessage): void {
  const target = /^https?:\/\/([^/?#@]+)([/?][^#]*)?$/i.exec(req.url ?? '')
  if (target === null) return
  const [, authority, rest = '/'] = target
  req.url = rest[0] === '?' ? `/${rest}` : rest
  req.headers.host = authority
}

/** The longest request target (path and query) Latch reads: what it keeps of a request is bounded by it. */
const MAX_REQUEST_TARGET = 8_192

/**
 * The most header lines Latch reads. node:http keeps about the first 1,000 (`maxHeadersCount`
 * counts names and values) and drops the rest unseen, 16 KiB holds 4,000 short ones, and a
 * second `Host` or a `Content-Encoding` past them would go unchecked: a request with more is
 * refused whole.
 */
const MAX_HEADER_LINES = 1_000

/**
 * Without a password, anyone who can load a page from this server can approve a sign-in. A web
 * page on another name that resolves to 127.0.0.1 (DNS rebinding) could; so only requests for
 * the issuer's host or a loopback name are served; not one that names no host (HTTP/1.0 allows it).
 */
function isOwnHost(hostHeader: string, ownHosts: Set<string>): boolean {
  return ownHosts.has(unbracketed(hostHeader.toLowerCase().replace(/:\d*$/, '')))
}

/**
 * Whether a request came from this machine: over loopback, or a Unix socket. Without a password,
 * `HOST` keeps Latch's own command on loopback; an app that embeds Latch listens where it likes
 * (Express's `app.listen(port)` takes every interface), so a server without a password also looks
 * at who connected, and the Host header a stranger writes is not enough. A TCP connection already
 * reset has no address either: only a server listening on a path (a Unix socket) vouches for it.
 */
function isLocalPeer(req: IncomingMessage): boolean {
  if (req.socket.remoteAddress !== undefined) return isLoopbackPeer(req)
  const server = (req.socket as Socket & { server?: NetServer }).server
  return typeof server?.address() === 'string'
}

/** Whether a request came over loopback TCP. */
function isLoopbackPeer(req: IncomingMessage): boolean {
  const address = plainAddress(req.socket.remoteAddress ?? '')
  return address === '::1' || address.startsWith('127.') // no IPv6 address starts so
}

/**
 * Whether a request names its host more than once, which "a server MUST respond [to] with a 400
 * (Bad Request)": node:http keeps the first, and a proxy in front might have read another.
 * @see https://www.rfc-editor.org/rfc/rfc9112#section-3.2 RFC 9112 §3.2
 */
function hasSeveralHosts(req: IncomingMessage): boolean {
  let hosts = 0
  for (let i = 0; i < req.rawHeaders.length; i += 2) {
    if (req.rawHeaders[i].length === 4 && req.rawHeaders[i].toLowerCase() === 'host') hosts++
  }
  return hosts > 1
}

/** The host names served without a password: loopback names and the issuer's; with a password, any. */
function ownHostsOf(config: Config): Set<string> | undefined {
  if (config.passwordHash !== undefined) return undefined
  return new Set([...LOOPBACK_HOSTS, unbracketed(new URL(config.issuer).hostname)])
}

/**
 * The router's one catch: an `OAuthError` is rendered; a change the data file could not take
 * (`NotStored`: a full disk, say) is a 500 whose cause the journal has logged already; anything
 * else is a 500 whose stack is logged here. A 500's JSON is `{"error":"server_error"}` alone.
 */
function renderError(error: unknown, req: IncomingMessage, res: ServerResponse, asPage: boolean, ctx: Context): void {
  const err = error instanceof NotStored ? NOT_STORED : error
  ;(res as MarkedResponse)[LOGGED_ERROR] = err instanceof OAuthError ? err.error || undefined : 'server_error'
  if (err instanceof OAuthError && err.event !== undefined) logEvent(ctx, 'security', err.event, req)
  if (res.headersSent) {
    res.destroy()
    return
  }
  if (err instanceof OAuthError) {
    // a browser that followed a wrong link gets a page, a program its JSON
    const browser = (err.status === 404 || err.status === 405) && /\btext\/html\b/.test(req.headers.accept ?? '')
    if (asPage || browser) sendErrorPage(res, err, isOwnersForm(pathOf(req.url ?? '/')))
    else if (err.status === 500)
      sendJson(res, 500, { error: 'server_error' }) // the contract's 500: no detail
    else sendJsonError(res, err)
    return
  }
  logEvent(ctx, 'error', err instanceof Error ? (err.stack ?? err.message) : String(err), req)
  if (asPage)
    sendErrorPage(
      res,
      new OAuthError('server_error', 'Something went wrong on the server: try again later', { status: 500 }),
    )
  else sendJson(res, 500, { error: 'server_error' })
}

// =================================================================================================
// PART 2: WHAT IT LEANS ON
// The log, HTTP plumbing, the server and its connection limits, pages, cookies and sessions,
// sign-in checks (password and passkey attempts), the owner's password and passkeys (WebAuthn),
// the owner's pages (sign-in, connected apps, tokens for scripts, passkeys), client fetching, the
// stores and the journal, the performance internals, the configuration and the command line.
// Each section says first what it is for.
// =================================================================================================

// --- The log --------------------------------------------------------------------
// One line per request: when, from where, what, how it ended, and for whom; and a line of its
// own for what deserves one: a security event, an app that could not be fetched, a warning, a
// server error.
// `LOG_FORMAT=json` makes each line a JSON object. Never a code, token, verifier, password or
// hash. Of what a request sent, only its `client_id`, its address (from `X-Forwarded-For` behind
// a trusted proxy) and the names the owner gives tokens and passkeys are logged.

/**
 * A `log` as Latch calls it: one that throws, or returns a promise that rejects (an embedding
 * app's, writing to a disk that is full, say), loses its line, and nothing more. Latch logs from
 * timers, from failures it is recovering from, and before it answers: a throw there would end the
 * process, or leave a request unanswered.
 */
function neverThrowing(log: (line: string) => void): (line: string) => void {
  const lost = (err: unknown) => {
    try {
      console.error(`latch: a line could not be logged: ${String(err)}`)
    } catch {
      console.error('latch: a line could not be logged') // what was thrown cannot even be said
    }
  }
  return (line) => {
    try {
      const written: unknown = log(line)
      if (written instanceof Promise) written.catch(lost)
    } catch (err) {
      lost(err)
    }
  }
}

/** A line of the log: a request answered (`method` to `ms`), or an `event` and its `message`. */
type LogEntry = {
  time: string
  address?: string
  method?: string
  path?: string
  status?: number | string
  ms?: number
  error?: string
  client_id?: string
  event?: string
  message?: string
}

/** The marks a handler leaves on a response for its log line: the OAuth error code and the client_id. */
const LOGGED_ERROR = Symbol('logged error')
const LOGGED_CLIENT = Symbol('logged client')

/** Notes the client a request is for, for its log line. */
function noteClient(res: ServerResponse, clientId: string | undefined): void {
  // only what may be a client identifier, an http(s) URL: a script that sends a token there (curl's
  // `-u TOKEN:` is read as the client_id) would have it logged
  if (clientId !== undefined)
    (res as MarkedResponse)[LOGGED_CLIENT] = /^https?:\/\//i.test(clientId) ? clientId : '(not a URL)'
}

/** Notes the OAuth error an answer carries, for its log line (an error redirect is a 302 or a 303). */
function noteError(res: ServerResponse, error: string): void {
  ;(res as MarkedResponse)[LOGGED_ERROR] = error
}

/** Logs something that happened (`security`, `discovery`, `warning`, `error`), with the request's address, if any. */
function logEvent(ctx: Context, event: string, message: string, from?: IncomingMessage | string): void {
  const address = from === undefined || typeof from === 'string' ? from : clientAddress(from, ctx.trustedProxies)
  ctx.log(formatLogEntry({ time: logTime(ctx.now()), address, event, message }, ctx.config.logFormat))
}

/**
 * One line: `time address METHOD path status Nms error=… client_id=…`, or `time address event:
 * message`; or the entry as JSON. What a client chose is quoted as JSON when it holds anything but
 * printable ASCII, so that no one can write a line of their own into the log.
 */
function formatLogEntry(entry: LogEntry, format: Config['logFormat']): string {
  if (format === 'json') return asciiJson(entry)
  const when = entry.address === undefined ? entry.time : `${entry.time} ${entry.address}`
  if (entry.method === undefined) return `${when} ${entry.event}: ${loggable(entry.message ?? '')}`
  let line = `${when} ${entry.method} ${entry.path ?? ''} ${entry.status} ${entry.ms}ms`
  if (entry.error !== undefined) line += ` error=${entry.error}`
  if (entry.client_id !== undefined)
    line += ` client_id=${PRINTABLE_ASCII.test(entry.client_id) ? entry.client_id : asciiJson(entry.client_id)}`
  return line
}

function loggable(text: string): string {
  return /^[\x20-\x7e]*$/.test(text) ? text : asciiJson(text)
}

/**
 * JSON in printable ASCII: what JSON leaves as it is beyond ASCII is escaped too (`\u202e`), so
 * that a bidi control a client sent cannot make a terminal show the line in another order.
 */
function asciiJson(value: unknown): string {
  return JSON.stringify(value).replace(/[^\x20-\x7e]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`)
}

/**
 * Logs a request once its connection is done with it. It counts as answered only if the whole
 * answer went to the socket: node:http may have closed it first, after bytes it could not parse,
 * and the client may have gone away. The response's own flags (`writableFinished`) can claim an
 * answer that never left; what tells is that node:http lets go of the socket (`res.socket` is
 * null) when, and only when, the last byte of the answer was handed to it.
 */
function logRequest(
  req: IncomingMessage,
  res: MarkedResponse,
  { address, path, started }: { address: string; path: string; started: bigint },
  ctx: Context,
): void {
  const answered = res.socket === null
  ctx.log(
    formatLogEntry(
      {
        time: logTime(ctx.now()),
        address,
        method: req.method ?? 'GET',
        path,
        status: answered ? res.statusCode : 'closed before the answer',
        ms: Math.round(Number(process.hrtime.bigint() - started) / 1e6),
        error: res[LOGGED_ERROR],
        client_id: res[LOGGED_CLIENT],
      },
      ctx.config.logFormat,
    ),
  )
}

/** The second the last log line was stamped in, and that second in ISO 8601 (`2026-11-27T10:39:34.`). */
let lastLogSecond = { second: NaN, text: '' }

/**
 * A log line's time, in ISO 8601. Formatting a `Date` was the costliest part of a request's log
 * line (V8 does it with printf), so it is done once a second, and the milliseconds are added.
 */
function logTime(now: number): string {
  const ms = Math.floor(now)
  const second = Math.floor(ms / 1000)
  if (second !== lastLogSecond.second)
    lastLogSecond = { second, text: new Date(second * 1000).toISOString().slice(0, -4) }
  return `${lastLogSecond.text}${String(ms - second * 1000).padStart(3, '0')}Z`
}

/** The path of `ISSUER`, where an app mounts Latch or a proxy strips: the log shows paths under it. */
function mountPath(config: Config): string {
  const { pathname } = new URL(config.issuer)
  return pathname === '/' ? '' : pathname
}

/**
 * The path as logged, under the path of `ISSUER` (where an app mounts Latch, or a proxy strips):
 * the one the client asked for. An unknown path is not, since a client may have put anything in it.
 */
function describePath(path: string, handler: Handler, mountedAt: string): string {
  return handler === rejectUnknownPath ? '(unknown path)' : mountedAt + path
}

/**
 * A log that gathers lines for up to `everyMs` (or 64 KiB) and writes them in one go. Writing to
 * a file or a terminal blocks; once a request, it cost as much as answering one. Lines still
 * waiting are written when the process exits. When the log cannot be written (the program that
 * read it has gone: EPIPE), the server goes on and its lines are dropped: an authorization
 * server must not stop because its log did. Nor may it grow without end: a pipe keeps in memory
 * whatever its reader has not read yet, and a reader can stop (a stuck log shipper, a paused
 * pager) or fall behind for good. Past 16 million characters unread, lines are counted and
 * dropped; as soon as the reader has caught up, a line of the writer's own (in the log's
 * format, by `format`) says how many.
 *
 * The writer's `flush` writes at once what waits, as before the process ends by a signal.
 *
 * `output` may also be the descriptor of a file (standard output sent to one: `>> latch.log`),
 * written directly. A stream that fails a write is done for good, and a full disk is not: its
 * lines are counted and dropped the same way, and once there is room the log goes on, with the
 * line that says how many it lost.
 */
export function createLineWriter(
  output: Writable | number,
  everyMs = 100,
  format = (line: string) => line,
): ((line: string) => void) & { flush: () => void; close: () => void } {
  let pending = ''
  let lines = 0
  let dropped = 0
  let timer: NodeJS.Timeout | undefined
  let broken = false
  const stream = typeof output === 'number' ? undefined : output
  const fd = typeof output === 'number' ? output : undefined
  const onError = () => (broken = true)
  stream?.on('error', onError)
  let torn = false // the file ends with part of a line, where the disk filled up
  /** Writes to the file: false when the disk took none of it, or only part (ended on the next write). */
  const writeFile = (fd: number, text: string): boolean => {
    const bytes = Buffer.from(torn ? `\n${text}` : text)
    let at = 0
    try {
      while (at < bytes.length) at += writeSync(fd, bytes, at)
      torn = false
      return true
    } catch {
      torn ||= at > 0
      return false
    }
  }
  const flush = () => {
    clearTimeout(timer)
    timer = undefined
    if (stream !== undefined && stream.writableLength > MAX_UNREAD_LOG) dropped += lines
    else if ((pending !== '' || dropped > 0) && !broken) {
      // after the lines, so that the times go on rising: the dropped lines came before them all
      const why = fd !== undefined ? 'the disk was full' : "the log's reader was behind"
      const notice = `log: ${dropped} lines dropped while ${why}`
      const text = dropped === 0 ? pending : `${pending}${format(notice)}\n`
      const written = fd !== undefined ? writeFile(fd, text) : (stream?.write(text), true)
      dropped = written ? 0 : dropped + lines
    }
    pending = ''
    lines = 0
  }
  const onDrain = () => dropped > 0 && flush() // the reader has caught up: say so now
  stream?.on('drain', onDrain)
  process.on('exit', flush)
  const write = (line: string) => {
    if (broken) return
    pending += `${line}\n`
    lines++
    if (pending.length >= 65_536) flush()
    else timer ??= setTimeout(flush, everyMs).unref() // the exit handler writes what is left
  }
  /** Writes what waits and lets go of the stream and the process: a writer made for each Latch a test starts. */
  const close = () => {
    flush()
    broken = true // lines written after are dropped
    stream?.off('error', onError).off('drain', onDrain)
    process.off('exit', flush)
  }
  return Object.assign(write, { flush, close })
}

/**
 * The most log output kept in memory for a reader that is behind, in characters (what a stream
 * counts of text): 16 MiB of ASCII.
 */
const MAX_UNREAD_LOG = 16 * 1024 * 1024

// --- HTTP plumbing --------------------------------------------------------------
// Read a form, send JSON, redirect. What OAuth asks of them (its error codes, and the JSON body of
// an error) is said where it is used; the pages come two sections on. Then who sent a request
// (its address, read through the proxies `TRUST_PROXY` names), a clock that never goes back,
// slots that bound how much of some work runs at once, and what a Latch keeps in memory beside its
// store (`Kept`), shared by every handler of one store and settings, with the timer that sweeps
// the store.

const MAX_BODY_BYTES = 64 * 1024

/**
 * Reads an `application/x-www-form-urlencoded` body of at most 64 KiB. A larger body is
 * answered with 413 and the rest of it is never buffered. So is one that comes in more than 256
 * pieces, with a 400: node:http calls into JavaScript for each chunk of a chunked body, and 64 KiB
 * sent a byte a chunk held the server for 90 ms.
 *
 * The form is UTF-8 (RFC 6749 Appendix B), and the media type has no `charset` parameter. Some
 * clients send one all the same (Java's Apache HttpClient says ISO-8859-1 by default): a form
 * labelled with a charset that agrees with ASCII is read if it is plain ASCII, which means the
 * same in either, and refused if it is not; one labelled UTF-16 or anything else, refused.
 * @see https://www.rfc-editor.org/rfc/rfc6749#appendix-B
 */
export async function readForm(req: IncomingMessage): Promise<Params> {
  const contentType = req.headers['content-type'] ?? ''
  if (contentType === FORM_TYPE) return parseForm((await readBody(req)).toString('latin1'))
  const [mediaType, ...parameters] = contentType.split(';').map((part) => part.trim().toLowerCase())
  if (mediaType !== FORM_TYPE) throw new OAuthError('invalid_request', `The body must be ${FORM_TYPE}`)
  // `charset=x`, `charset = x` from a sloppy client, or `charset="x"` with its quoted pairs undone
  const charsets = parameters.flatMap((parameter) => /^charset\s*=\s*(.*)$/.exec(parameter)?.[1] ?? [])
  if (charsets.length > 1) throw new OAuthError('invalid_request', 'The Content-Type names more than one charset')
  const charset = charsets[0]?.replace(/^"(.*)"$/, (_, quoted: string) => quoted.replace(/\\(.)/g, '$1'))
  if (charset === undefined || charset === 'utf-8' || charset === 'utf8') return parseForm(await readText(req))
  if (!ASCII_CHARSETS.test(charset)) throw new OAuthError('invalid_request', 'The body must be UTF-8')
  const text = await readText(req)
  // a byte past ASCII, sent as it is or percent-encoded, means one thing in UTF-8 and another in
  // this charset; a control byte sent as it is, no form holds
  if (/[^\t\n\r\x20-\x7e]|%[89a-f][0-9a-f]/i.test(text))
    throw new OAuthError('invalid_request', `The body is ${charset}, not plain ASCII: send it as UTF-8`)
  return parseForm(text)
}

/**
 * Charsets in which ASCII means what it means in UTF-8, under the names clients send: the common
 * labels (IANA's and the WHATWG Encoding Standard's) of ASCII, ISO 8859, KOI8 and the Windows
 * code pages. A form in one of them that is plain ASCII is read. The pattern also takes a few
 * spellings no registry lists (`iso8859_1`), and leaves out rarer labels (`iso-ir-101`, `greek`),
 * whose forms are refused as not UTF-8.
 */
const ASCII_CHARSETS = new RegExp(
  '^(us-ascii|ascii|us|csascii|cp367|ibm367|iso-ir-6|iso646-us|ansi_x3\\.4-19(68|86)' + // ASCII
    '|iso[-_]?8859[-_]?([1-9]|1[013-6])(:19(8[789]|92))?|iso-8859-[68]-i|csisolatin[1-69]|iso-ir-100|(ibm|cp)819' +
    '|latin-?([1-6]|8|9|10)|l([1-6]|8|9|10)|koi8-[ru]' + // ISO 8859, KOI8
    '|(x-)?cp125[0-8]|windows-125[0-8]|windows-874)$', // Windows
)

async function readText(req: IncomingMessage): Promise<string> {
  return (await readBody(req)).toString('latin1')
}

const FORM_TYPE = 'application/x-www-form-urlencoded'

/** The media type of a request's body, in lower case, without its parameters. */
function mediaTypeOf(req: IncomingMessage): string {
  return (req.headers['content-type'] ?? '').split(';')[0].trim().toLowerCase()
}

function readBody(req: IncomingMessage): Promise<Buffer> {
  if (Number(req.headers['content-length']) > MAX_BODY_BYTES) return Promise.reject(bodyTooLarge())
  const coding = codingRefused(req)
  if (coding !== undefined) return Promise.reject(coding)
  // the server's fault, not the client's: a logged 500 that tells the developer what to change
  if (req.readableEnded)
    return Promise.reject(
      new Error('the request body was read before Latch: mount Latch before any body parser (express.urlencoded)'),
    )
  return new Promise((resolve, reject) => {
    const body = new Gathered()
    let ended = false
    let pieces = 0
    req.on('data', (chunk: Buffer) => {
      if (++pieces > MAX_BODY_PIECES) {
        if (pieces === MAX_BODY_PIECES + 1) reject(bodyInPieces())
        return
      }
      if (body.size + chunk.length <= MAX_BODY_BYTES) body.add(chunk)
      else if (body.size <= MAX_BODY_BYTES) {
        body.size = Infinity // later chunks are read and dropped until the connection closes
        reject(bodyTooLarge())
      }
    })
    req.on('end', () => {
      ended = true
      resolve(body.bytes)
    })
    req.on('error', () => ended || reject(bodyCutShort()))
    req.on('close', () => ended || reject(bodyCutShort()))
  })
}

/**
 * A body in a coding Latch does not undo. node:http takes `chunked` off and leaves any other
 * transfer coding (`gzip, chunked`) on, so the bytes would be read as a form when they are not,
 * and perhaps not as a proxy in front read them. RFC 9112 §6.1 says a server SHOULD answer
 * 501 to a transfer coding it does not know: Latch departs from it, and answers 400, since a 5xx
 * would say the server failed, and a stranger's request gets a 4xx here, as every other does.
 * @see https://www.rfc-editor.org/rfc/rfc9112#section-6.1 RFC 9112 §6.1
 * @see https://www.rfc-editor.org/rfc/rfc9110#section-15.5.16 RFC 9110 §15.5.16
 */
function codingRefused(req: IncomingMessage): OAuthError | undefined {
  const transfer = req.headers['transfer-encoding']
  if (transfer !== undefined && transfer.toLowerCase() !== 'chunked') {
    return new OAuthError('invalid_request', 'The body must be sent as it is, or chunked: no other Transfer-Encoding')
  }
  const content = req.headers['content-encoding']
  if (content !== undefined && content.toLowerCase() !== 'identity') {
    return new OAuthError('invalid_request', 'The body must not be compressed: no Content-Encoding', {
      status: 415,
      headers: { 'Accept-Encoding': 'identity' },
    })
  }
  return undefined
}

/**
 * A body's bytes, gathered into one buffer as its pieces come. Each piece kept as it came costs a
 * few hundred bytes beside its own, however small it is: a body sent one byte at a time (a piece
 * of chunked encoding each) held hundreds of bytes of memory for every byte sent. A body that
 * comes in one piece, as nearly every one does, is kept as it came, without a copy.
 */
class Gathered {
  size = 0
  #bytes: Buffer = Buffer.alloc(0)
  #copied = false

  add(piece: Buffer): void {
    const size = this.size + piece.length
    if (this.size === 0) this.#bytes = piece
    else {
      if (!this.#copied || size > this.#bytes.length) {
        const room = Buffer.allocUnsafe(Math.max(2 * size, 4096))
        this.#bytes.copy(room, 0, 0, this.size)
        this.#bytes = room
        this.#copied = true
      }
      piece.copy(this.#bytes, this.size)
    }
    this.size = size
  }

  get bytes(): Buffer {
    return this.#copied ? this.#bytes.subarray(0, this.size) : this.#bytes
  }
}

const bodyTooLarge = () =>
  new OAuthError('invalid_request', 'The request body is larger than 64 KiB', {
    status: 413,
    headers: { Connection: 'close' },
  })
const bodyInPieces = () =>
  new OAuthError('invalid_request', `The request body came in more than ${MAX_BODY_PIECES} pieces`, {
    headers: { Connection: 'close' },
  })
const MAX_BODY_PIECES = 256
const bodyCutShort = () => new OAuthError('invalid_request', 'The request body ended early')

/** The path of a request target, without its query. */
function pathOf(target: string): string {
  const query = target.indexOf('?')
  return query === -1 ? target : target.slice(0, query)
}

/** The query parameters of a request target. */
function queryOf(target: string): Params {
  const query = target.indexOf('?')
  return parseForm(query === -1 ? '' : target.slice(query + 1))
}

const NO_STORE = { 'Cache-Control': 'no-store', Pragma: 'no-cache' }

/**
 * Marks the responses of endpoints that browser apps on any origin may call, as the router
 * finds them. Their headers get `Access-Control-Allow-Origin: *` where they are written:
 * setting it early with `res.setHeader` would send node:http down a slower path for every
 * other header. A mark on the response itself, not a WeakSet: adding to a WeakSet on every
 * request costs the garbage collector more than the rest of the router.
 */
const CORS = Symbol('cors')

type MarkedResponse = ServerResponse & { [CORS]?: true; [LOGGED_ERROR]?: string; [LOGGED_CLIENT]?: string }

/** Adds `Access-Control-Allow-Origin: *` to a fresh headers object when the response is a CORS one. */
function withCors(res: MarkedResponse, headers: OutgoingHttpHeaders): OutgoingHttpHeaders {
  if (res[CORS] === true) headers['Access-Control-Allow-Origin'] = '*'
  return headers
}

/** Sends a JSON body. Every JSON answer carries `no-store`: most hold codes or tokens. */
function sendJson(res: ServerResponse, status: number, body: unknown, headers?: Record<string, string>): void {
  const json = JSON.stringify(body)
  const head = withCors(res, {
    'Content-Type': 'application/json',
    'Content-Length': Buffer.byteLength(json),
    'Cache-Control': 'no-store',
    Pragma: 'no-cache',
  })
  writeAnswer(res, status, headers === undefined ? head : Object.assign(head, headers), json)
}

/** Answers 200 with no body, as revocation does. */
function sendEmptyOk(res: ServerResponse): void {
  // a length, not an empty chunked body
  writeAnswer(res, 200, withCors(res, { 'Content-Length': 0, ...NO_STORE }), '')
}

/**
 * Writes an answer of the endpoints that programs call (JSON, and revocation's empty 200), at
 * once. Deferring it to `setImmediate`, so that the answers to many connections leave together,
 * saved CPU only for a load generator on the same machine; a client one request at a time, or
 * across a network, pays for the extra turn of the event loop instead (`npm run bench`, paced).
 */
function writeAnswer(res: ServerResponse, status: number, headers: OutgoingHttpHeaders, body: string): void {
  if (res.headersSent || res.destroyed) return // answered meanwhile, or the connection is gone
  try {
    closeIfBodyUnread(res)
    res.writeHead(status, headers)
    res.end(body)
  } catch {
    res.destroy() // only an embedding app's hook on writeHead could throw here: close, do not crash
  }
}

/** Sends an OAuth error as JSON. */
function sendJsonError(res: ServerResponse, err: OAuthError): void {
  const error = err.error === NO_ERROR_CODE ? undefined : err.error
  // a browser app may read a challenge, or when to try again, only once told it may
  const exposed = Object.keys(err.headers).filter((name) => name === 'WWW-Authenticate' || name === 'Retry-After')
  const cors = exposed.length > 0 && (res as MarkedResponse)[CORS] === true
  const headers = cors ? { ...err.headers, 'Access-Control-Expose-Headers': exposed.join(', ') } : err.headers
  sendJson(res, err.status, { error, error_description: err.message }, headers)
}

/**
 * Closes the connection after this answer when the request's body was not read to its end (a
 * refusal before reading it, or a route that reads none): to reach the next request on the
 * connection, node:http would read and drop the rest, however long a stranger made it.
 */
function closeIfBodyUnread(res: ServerResponse): void {
  const { complete, headers, rawHeaders } = res.req
  const announced =
    headers['transfer-encoding'] !== undefined ||
    Number(headers['content-length']) > 0 ||
    rawHeaders.length > 2 * MAX_HEADER_LINES // among the headers node:http dropped unseen, it may be
  if (!complete && announced) res.shouldKeepAlive = false
}

/** Redirects with the given status (302 from `GET /auth`, 303 after a form, 307 to the issuer's own name). */
function redirect(res: ServerResponse, status: number, location: string, headers: Record<string, string> = {}): void {
  closeIfBodyUnread(res)
  res.writeHead(status, { Location: location, ...NO_STORE, 'Referrer-Policy': 'no-referrer', ...headers })
  res.end()
}

/** Adds parameters to a URL, keeping the query it already has byte for byte. */
export function buildRedirectUrl(base: string, params: Record<string, string | undefined>): string {
  const query = new URLSearchParams()
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined) query.append(name, value)
  }
  const separator = !base.includes('?') ? '?' : base.endsWith('?') || base.endsWith('&') ? '' : '&'
  return `${base}${separator}${query}`
}

/** A clock that goes forward as `now` does, and waits while `now` goes back (see `Context.steadyNow`). */
function steadyClock(now: () => number): () => number {
  let wall = now()
  let steady = wall
  return () => {
    const next = now()
    steady += Math.max(0, next - wall)
    wall = next
    return steady
  }
}

/**
 * What a Latch keeps in memory besides its store, one set for each store and configuration,
 * which all their handlers share instead of each starting from zero: handlers made at each
 * request, or two serving one Latch, count wrong passwords and refreshes once, on one steady
 * clock, know each other's passkey challenges, share discovery's cache and slots, warn of an
 * unnamed proxy once, and sweep the store once. Handlers of one store with other settings
 * (another password, another `ISSUER`) are other Latches, and keep their own.
 */
type Kept = {
  shared: Pick<
    Context,
    | 'steadyNow'
    | 'signInAttempts'
    | 'passwordSlots'
    | 'clients'
    | 'failedClients'
    | 'clientLookups'
    | 'lookupsBy'
    | 'clientFetchSlots'
    | 'refreshes'
    | 'passkeys'
    | 'startedAt'
    | 'scriptGrantsUnderWay'
    | 'scriptGrantsWithoutToken'
    | 'scriptTokensMadeLately'
    | 'answered'
  >
  /** The clock of the first handler, which the sweep follows. */
  now: () => number
  /** Whether a proxy that TRUST_PROXY does not name is still to be warned of; the last one seen named. */
  proxyWarning: { pending: boolean; named?: string }
  /**
   * The signals of the handlers that sweep, held weakly (an app may make a handler, and a signal,
   * at each request), how many of them are yet to abort, `forever` once one has none, and the
   * timer they share. A signal collected unaborted can never abort: it is counted for good.
   */
  signals: WeakSet<AbortSignal>
  unaborted: number
  forever: boolean
  sweeping?: NodeJS.Timeout
}

const keptByStore = new WeakMap<Store, Map<string, Kept>>()

function keptFor(store: Store, config: Config, now: () => number): Kept {
  const byConfig = keptByStore.get(store) ?? new Map<string, Kept>()
  keptByStore.set(store, byConfig)
  // what makes another Latch: not where it listens, nor how it logs, nor the order of fields or proxies
  const { host, port, dataFile, logFormat, ...answers } = config
  const key = JSON.stringify(inOrder(answers))
  let kept = byConfig.get(key)
  if (kept === undefined) {
    const shared: Kept['shared'] = {
      steadyNow: steadyClock(now),
      signInAttempts: { byAddress: new Map(), total: NO_ATTEMPTS },
      passwordSlots: { running: 0, waiting: [] },
      clients: new Map(),
      failedClients: new Map(),
      clientLookups: new Map(),
      lookupsBy: new Map(),
      clientFetchSlots: { running: 0, waiting: [] },
      refreshes: new Map(),
      passkeys: { key: randomBytes(32), used: new Map(), changes: Promise.resolve() },
      startedAt: now(),
      scriptGrantsUnderWay: new Map(),
      scriptGrantsWithoutToken: new Set(),
      scriptTokensMadeLately: new Map(),
      answered: new Map(),
    }
    // cleared once said; without a password, such a request is refused (`refusalOf`) and says why itself
    const proxyWarning = { pending: config.passwordHash !== undefined }
    kept = { shared, now, proxyWarning, signals: new WeakSet(), unaborted: 0, forever: false }
    byConfig.set(key, kept)
  }
  return kept
}

/** A value with the fields of its objects, and its lists, sorted: the same settings, one key. */
function inOrder(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(inOrder).sort()
  if (value === null || typeof value !== 'object') return value
  return Object.fromEntries(
    Object.entries(value)
      .sort(([a], [b]) => (a < b ? -1 : 1))
      .map(([name, field]) => [name, inOrder(field)]),
  )
}

/**
 * Sweeps expired entries from the store every 100 ms, even while no one writes, without costing a
 * request anything; until the signal of every handler that asked is aborted (never, once one
 * without a signal asked). One listener for each signal, however many handlers it stops.
 */
function keepSweeping(kept: Kept, store: MemoryStore | FileStore, signal: AbortSignal | undefined): void {
  if (signal === undefined) kept.forever = true
  else if (!kept.signals.has(signal)) {
    kept.signals.add(signal)
    kept.unaborted++
    const stop = () => {
      if (--kept.unaborted > 0 || kept.forever) return
      clearInterval(kept.sweeping)
      kept.sweeping = undefined
    }
    signal.addEventListener('abort', stop, { once: true })
  }
  kept.sweeping ??= setInterval(() => store.sweep(kept.now()), 100).unref()
}

/**
 * The client's address: the connection's, or, when that is a proxy of `TRUST_PROXY`, the one its
 * `X-Forwarded-For` names. The header is read from the right, where each proxy appends the
 * address it was reached from, past the trusted proxies: the first address that is not one is the
 * client, and what lies left of it, anyone could have written. Without `X-Forwarded-For`, the
 * `for=` of `Forwarded` (RFC 7239) is read the same way.
 * @see https://www.rfc-editor.org/rfc/rfc7239#section-5.2
 */
function clientAddress(req: IncomingMessage, trusted: BlockList | undefined): string {
  const peer = plainAddress(req.socket.remoteAddress ?? 'unknown')
  if (trusted === undefined || !isTrustedProxy(peer, trusted)) return peer
  let client = peer
  for (const hop of forwardedChain(req).reverse()) {
    const address = plainAddress(hop)
    if (isIP(address) === 0) break // not an address: the client wrote it
    client = address
    if (!isTrustedProxy(address, trusted)) break
  }
  return client
}

/**
 * The addresses a request passed through, as its proxies wrote them, the client's first, less
 * any port: `Forwarded` may carry one, and some proxies add one to X-Forwarded-For too.
 */
function forwardedChain(req: IncomingMessage): string[] {
  const forwardedFor = req.headers['x-forwarded-for']
  let hops: string[]
  if (forwardedFor !== undefined) hops = [forwardedFor].flat().join(',').split(',')
  else {
    const fors = (req.headers.forwarded ?? '').matchAll(/(?:^|[;,\s])for\s*=\s*("[^"]*"|[^;,\s]*)/gi)
    hops = [...fors].map(([, value]) => value.replace(/^"|"$/g, ''))
  }
  return hops.map((hop) =>
    hop
      .trim()
      .replace(/^\[([^\]]*)\](?::\d+)?$/, '$1') // [2001:db8::1]:4711
      .replace(/^(\d+\.\d+\.\d+\.\d+):\d+$/, '$1'),
  )
}

/** An IPv4 address as itself, not in the IPv6 form (`::ffff:192.0.2.1`) a dual-stack socket reports. */
function plainAddress(address: string): string {
  return address.startsWith('::ffff:') && isIP(address.slice(7)) === 4 ? address.slice(7) : address
}

function isTrustedProxy(address: string, trusted: BlockList): boolean {
  return trusted.check(address, isIP(address) === 6 ? 'ipv6' : 'ipv4')
}

/** The proxies of `TRUST_PROXY` as a list to check addresses against, or undefined when there are none. */
function trustedProxiesOf(config: Config): BlockList | undefined {
  if (config.trustProxy.length === 0) return undefined
  const list = new BlockList()
  for (const entry of config.trustProxy) {
    const [address, prefix] = entry.split('/')
    const type = isIP(address) === 6 ? 'ipv6' : 'ipv4'
    if (prefix === undefined) list.addAddress(address, type)
    else list.addSubnet(address, Number(prefix), type)
  }
  return list
}

/**
 * Runs a task when fewer than `limits.running` run, queued in order behind at most
 * `limits.waiting`; past that, throws `busy()`.
 */
async function withSlot<T>(
  slots: Slots,
  limits: { running: number; waiting: number },
  busy: () => Error,
  task: () => Promise<T>,
): Promise<T> {
  if (slots.running < limits.running) {
    slots.running++
  } else if (slots.waiting.length < limits.waiting) {
    await new Promise<void>((resolve) => slots.waiting.push(resolve)) // the slot is handed over by the task that ends
  } else {
    throw busy()
  }
  try {
    return await task()
  } finally {
    const next = slots.waiting.shift()
    if (next === undefined) slots.running--
    else next()
  }
}

// --- The server -----------------------------------------------------------------
// node:http's server, with the limits a server open to strangers needs: how long a client may
// take, how many connections one address and all of them may hold, how many answers may wait
// behind one, and a stop that lets answers under way finish.

/**
 * How long a client may take: to send its headers, its whole request, and between requests; and
 * how long nothing may move on its connection, which is how a client that stops reading its
 * answers shows.
 */
export type ServerTimeouts = {
  headersMs: number
  requestMs: number
  keepAliveMs: number
  checkEveryMs: number
  idleMs: number
}

const SERVER_TIMEOUTS: ServerTimeouts = {
  headersMs: 10_000,
  requestMs: 30_000,
  keepAliveMs: 5_000,
  checkEveryMs: 1_000,
  idleMs: 60_000,
}

/**
 * How many connections may be open at once: in all, and from one address. `groupOf` names what
 * an address counts as, for the second limit, or undefined when it is not limited.
 */
export type ConnectionLimits = {
  total: number
  perAddress: number
  groupOf: (address: string) => string | undefined
}

/**
 * A person's server needs a few dozen connections. Each costs some 7 KB while it waits for its
 * request, and closing many at once stalls node:http, so a stranger who opens them by the
 * thousand must not be kept: past either limit, a new connection is closed at once. The limit
 * by address keeps one stranger from taking them all; it spares loopback, where a proxy on this
 * machine sends every client's requests from.
 */
export const CONNECTION_LIMITS: Readonly<ConnectionLimits> = Object.freeze({
  total: 10_000,
  perAddress: 100,
  groupOf: (address: string) => (/^(127\.|::1$|::ffff:127\.)/.test(address) ? undefined : addressGroup(address)),
}) // every server's default, and so the same for all: give a server limits of its own instead

/**
 * The most answers one connection may have waiting behind one not yet sent whole. A client may
 * send its next requests without waiting for the answers (HTTP/1.1 pipelining; no browser does),
 * and node:http answers them all, each kept in memory until the ones before it are sent: a
 * consent page with its logo weighs some 90 KB, and a client that never reads had gigabytes
 * piled up within seconds. Past this, the connection is closed at once, answers unsent. The
 * requests that came in the same read go to the handler all the same, on a closed connection: it
 * answers none of them.
 */
const MAX_QUEUED_ANSWERS = 8

/**
 * What one client's connections count as: an IPv4 address itself, and for IPv6 its /64, since
 * one host is given a whole /64 and may use any address in it. An IPv4 client that an IPv6 one
 * carries (mapped, or translated, as NAT64 writes every IPv4 client of an IPv6-only server) is
 * counted by its IPv4 address: one /64 would hold them all.
 */
function addressGroup(address: string): string {
  if (!isIPv6(address)) return address
  const ipv4 = embeddedIpv4(address)
  if (ipv4 !== undefined) return ipv4
  const prefix = ipv6Words(address)
    .slice(0, 4)
    .map((word) => word.toString(16))
    .join(':')
  return `${new URL(`http://[${prefix}::]/`).hostname.slice(1, -1)}/64` // as an address is written: 2001:db8::/64
}

/**
 * node:http's answer to a request it could not read, by the code of its error: a status, and a
 * line that says why; else `NOT_READ`. A request that ran out of time gets no line: node:http
 * keeps none of its bytes, so which method it was is not known (see `clientErrorAnswer`).
 */
const CLIENT_ERRORS: Record<string, { status: number; why?: string }> = {
  ERR_HTTP_REQUEST_TIMEOUT: { status: 408 },
  HPE_CHUNK_EXTENSIONS_OVERFLOW: { status: 413, why: 'The chunk extensions of the request are too large.' },
  // what a browser meets when pages on another port of this host name, or on a sibling host, have
  // set it more cookies than fit: Latch is out of its reach until they are gone
  HPE_HEADER_OVERFLOW: {
    status: 431,
    why:
      'The headers of the request are too large. In a browser, that is most often cookies that other pages ' +
      "on this host name set: clear this site's cookies, then try again.",
  },
}
const NOT_READ = { status: 400, why: 'The request is not HTTP that this server can read.' }

/**
 * node:http's refusal of a request it could not read, with a line of text that says why: a
 * browser shows it, where it would show an error of its own for an answer with no body. Not to a
 * HEAD, whose answer has no body. node:http does not say which method it was reading, only the
 * bytes it was given last and how far it read them: the refused request's own begin after the
 * last blank line (`\r\n\r\n`) in them, where another request ended. Where they begin with a
 * method, that is its method; else its first bytes came in an earlier piece (16 KiB of headers
 * rarely come in one), and it is taken to be what a browser sends, not a HEAD.
 */
function clientErrorAnswer(err: NodeJS.ErrnoException & { rawPacket?: Buffer; bytesParsed?: number }): string {
  const { status, why } = CLIENT_ERRORS[err.code ?? ''] ?? NOT_READ
  const statusLine = `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\n`
  const read = err.rawPacket?.subarray(0, err.bytesParsed ?? 0).toString('latin1') ?? ''
  const blank = read.lastIndexOf('\r\n\r\n')
  if (why === undefined || /^HEAD /.test(blank === -1 ? read : read.slice(blank + 4)))
    return `${statusLine}Connection: close\r\n\r\n`
  return (
    `${statusLine}Content-Type: text/plain; charset=utf-8\r\nContent-Length: ${why.length + 1}\r\n` +
    `X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n${why}\n`
  )
}

/** Closes a connection after `ms` at the latest, whatever its client does or does not read. */
function closeWithin(socket: Socket, ms: number): void {
  const cut = setTimeout(() => socket.destroy(), ms).unref()
  socket.once('close', () => clearTimeout(cut))
}

/**
 * An http server whose slow clients cannot hold a connection for long (slowloris): headers
 * within 10 s, the whole request within 30 s, 5 s idle between requests, checked every second.
 * A client that stops reading its answers stalls node:http's writes, and then none of those
 * apply: a connection on which nothing moves for a minute, while it waits on its client, is
 * closed. And no more connections than `limits` allow, nor more than 8 answers waiting on one of
 * them (see `MAX_QUEUED_ANSWERS`). Connections closed for a limit are said in `log`, at most once
 * a minute. An `Expect` other than 100-continue is answered 417, and the connection closed,
 * without reading the body. Bytes that are no request close the connection too, but only once
 * the answers to the requests before them have gone out whole (within the 5 s of keep-alive).
 * Attach the handler with `server.on('request', handler)`.
 */
export function createLatchServer(
  timeouts: ServerTimeouts = SERVER_TIMEOUTS,
  limits: ConnectionLimits = CONNECTION_LIMITS,
  log: (line: string) => void = () => {},
): Server {
  const logLine = neverThrowing(log)
  const server = createServer({
    headersTimeout: timeouts.headersMs,
    requestTimeout: timeouts.requestMs,
    keepAliveTimeout: timeouts.keepAliveMs,
    connectionsCheckingInterval: timeouts.checkEveryMs,
  })
  // Idle is a connection that waits on its client: one whose answer is all handed to node:http,
  // or that has no request under way. One whose answer the server is still making (a journal
  // write on a slow disk) is left alone; the next write starts its clock again.
  const answers = new WeakMap<Socket, ServerResponse>()
  let stopping = false // set by `closeLatchServer`
  const closing = new WeakSet<ServerResponse>() // answers under way at the stop, marked to close their connection
  const queued = new WeakMap<Socket, number>() // answers made behind one not yet sent whole
  server.on('request', (req: IncomingMessage, res: ServerResponse) => {
    const socket = req.socket
    if (socket.destroyed) return // the rest of what a connection closed below had sent at once
    const before = answers.get(socket)
    answers.set(socket, res)
    // a request sent behind an answer that the stop marked to close the connection: that answer
    // leaves it open after all, so that this one is answered too, and this one's closes it
    if (stopping && before !== undefined && closing.has(before) && !before.headersSent) before.shouldKeepAlive = true
    if (before === undefined || before.writableFinished) return // the usual case: one at a time
    const count = (queued.get(socket) ?? 0) + 1
    if (count > MAX_QUEUED_ANSWERS) {
      drop('queued', socket.remoteAddress)
      return void socket.destroy()
    }
    queued.set(socket, count)
    res.once('close', () => queued.set(socket, (queued.get(socket) ?? 1) - 1))
  })
  server.setTimeout(timeouts.idleMs, (socket: Socket) => {
    if (answers.get(socket)?.writableEnded !== false) socket.destroy()
  })
  // Bytes node:http cannot read, behind requests whose answers are made (sent in one go with them):
  // those answers go out whole, in order, and then the connection closes. node:http itself closes
  // it at once, which from Node 24 on cut the answer being written short. A client that does not
  // read them has as long as one may wait between requests: what it sends meanwhile is never a
  // request, and would keep any other timer from running out. Else, node:http's refusal (400, or
  // 408, 413, 431) with a line that says why (`clientErrorAnswer`), unless an answer has begun, and
  // the connection closed.
  server.on('clientError', (err: NodeJS.ErrnoException, socket: Socket) => {
    const answer = answers.get(socket) // the last made; those before it go out before it
    const made = answer !== undefined && answer.writableEnded && !answer.writableFinished
    if (made && err.code !== 'ERR_HTTP_REQUEST_TIMEOUT') {
      answer.once('finish', () => socket.end())
      return closeWithin(socket, timeouts.keepAliveMs)
    }
    const begun = answer !== undefined && !answer.writableFinished && (answer.headersSent || answer.socket === null)
    if (socket.writable && !begun) socket.write(clientErrorAnswer(err))
    socket.destroy(err)
  })
  server.maxConnections = limits.total
  // A flood closes thousands a second: the first is said at once; then, for as long as more
  // come, one line a minute says how many were closed in it, for each limit.
  const pastLimit = {
    perAddress: `past ${limits.perAddress} from one client`,
    total: `past ${limits.total} in all`,
    queued: `past ${MAX_QUEUED_ANSWERS} answers waiting`,
  }
  const dropped = { perAddress: 0, total: 0, queued: 0, last: '', minute: undefined as NodeJS.Timeout | undefined }
  const endMinute = () => {
    const counts = (['perAddress', 'total', 'queued'] as const).filter((limit) => dropped[limit] > 0)
    if (counts.length === 0) return void (dropped.minute = undefined)
    const said = counts.map((limit) => `${dropped[limit]} ${pastLimit[limit]}`).join(', ')
    logLine(`security: connections closed at once in the last minute: ${said} (the last from ${dropped.last})`)
    Object.assign(dropped, { perAddress: 0, total: 0, queued: 0, minute: setTimeout(endMinute, 60_000).unref() })
  }
  const drop = (limit: 'perAddress' | 'total' | 'queued', address = 'an unknown address') => {
    if (dropped.minute === undefined) {
      logLine(`security: a connection from ${address} was closed at once, ${pastLimit[limit]}`)
      dropped.minute = setTimeout(endMinute, 60_000).unref()
    } else {
      dropped[limit]++
      dropped.last = address
    }
  }
  server.on('drop', (data?: { remoteAddress?: string }) => drop('total', data?.remoteAddress)) // past maxConnections
  // An expectation other than 100-continue: node:http would answer 417 itself, keep the
  // connection, and read the body to its end however long it is. The 417 closes it instead.
  server.on('checkExpectation', (_req: IncomingMessage, res: ServerResponse) => {
    res.writeHead(417, { Connection: 'close', 'Content-Length': '0', ...NO_STORE })
    res.end()
  })
  // CONNECT asks a proxy for a tunnel, and node:http hands it here instead of to the handler:
  // without this, it would close the connection without a word. node:http no longer watches such
  // a socket (no timeout, and `closeAllConnections` does not reach it): it is closed here, whole,
  // once the answer is out, or after 5 s for a client that does not read it
  server.on('connect', (_req: IncomingMessage, socket: Socket) => {
    socket.on('error', () => {})
    closeWithin(socket, 5_000)
    socket.end(
      'HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, POST, OPTIONS\r\nContent-Length: 0\r\nConnection: close\r\n\r\n',
      () => socket.destroy(),
    )
  })
  const connections = new Set<Socket>()
  // at a stop, an answer still being made goes out with `Connection: close`: its client sends no
  // further request on a connection about to be closed under it
  answersInFlight.set(server, () => {
    stopping = true
    for (const socket of connections) {
      const answer = answers.get(socket)
      if (answer === undefined || answer.headersSent || !answer.shouldKeepAlive) continue
      answer.shouldKeepAlive = false
      closing.add(answer)
    }
  })
  const open = new Map<string, number>() // connections by address group, for those limited
  server.on('connection', (socket: Socket) => {
    connections.add(socket)
    socket.once('close', () => connections.delete(socket))
    const group = socket.remoteAddress === undefined ? undefined : limits.groupOf(socket.remoteAddress)
    if (group === undefined) return
    const count = (open.get(group) ?? 0) + 1
    if (count > limits.perAddress) {
      drop('perAddress', socket.remoteAddress)
      return void socket.destroy()
    }
    open.set(group, count)
    socket.once('close', () => {
      const left = (open.get(group) ?? 1) - 1
      if (left === 0) open.delete(group)
      else open.set(group, left)
    })
  })
  return server
}

/** For each server made by `createLatchServer`: marks the answers it is making to close their connection. */
const answersInFlight = new WeakMap<Server, () => void>()

/**
 * Stops a server the way Latch's command does at SIGTERM, and resolves once it has: no new
 * connections; requests in flight answered, and they and those that come meanwhile with
 * `Connection: close` (those in flight, on a server made by `createLatchServer`); connections
 * closed as soon as they are idle; and whatever is still open after 5 s (a client that sent half
 * its headers, or never reads its answer) cut off, its request logged. `server.close()` alone
 * closes only the connections idle at that moment and stops node:http's request-timeout checks,
 * so a stalled connection keeps it open until the idle timeout: a minute here.
 */
export function closeLatchServer(server: Server): Promise<void> {
  return new Promise((resolve) => {
    // The server closes as the last connection is cut, but that connection's own close (which
    // logs its request) comes at the end of the event loop's turn, after this turn's immediates:
    // the next turn's come after it.
    server.close(() => setImmediate(() => setImmediate(resolve)))
    // A client that keeps its connection busy never lets it go idle: each request from now on
    // is answered with `Connection: close`, and a connection is closed once its answer is out.
    server.prependListener('request', (_req: IncomingMessage, res: ServerResponse) => {
      res.shouldKeepAlive = false
    })
    answersInFlight.get(server)?.()
    server.closeIdleConnections()
    const idle = setInterval(() => server.closeIdleConnections(), 100).unref()
    const cut = setTimeout(() => server.closeAllConnections(), 5_000).unref()
    server.once('close', () => {
      clearInterval(idle)
      clearTimeout(cut)
    })
  })
}

// --- Pages ----------------------------------------------------------------------
// Plain HTML, nothing loaded from elsewhere, and no script but `/passkey.js`, on the pages that
// offer a passkey (see `passkeyPageHeaders`). The one stylesheet is allowed by its hash, so the
// Content-Security-Policy can keep `default-src 'none'`.

/**
 * The one stylesheet. Its buttons show only 0.6 s after a page does, and take neither a click nor
 * a key until then: a page elsewhere that asks for a double click can open the consent page on
 * the first click, under the pointer, so that the second lands on Approve ("double-clickjacking"),
 * or ask for Tab and Enter; a signed-in owner's consent needs nothing more. (Enter in a field of
 * the consent form sends nothing at any time: see `renderConsentPage`.) Framing is refused
 * (`frame-ancestors`), but this is a page of its own. A consent page opened earlier behind
 * another window, and shown when that window closes, is not covered.
 */
const STYLESHEET = `
:root {
  color-scheme: light dark;
  --fg: #1c1b1f;
  --bg: #fbfbfd;
  --muted: #55535e;
  --line: #c9c7d1;
  --field: #85838f; /* a field's border, the one sign of where it is: 3:1 and more in light and dark (WCAG 1.4.11) */
  --accent: #1f4fd1;
  --danger: #b3261e;
  --panel: #fff;
}
@media (prefers-color-scheme: dark) {
  :root {
    --fg: #ecebf1;
    --bg: #141318;
    --muted: #b2b0bc;
    --line: #45434d;
    --accent: #9db7ff;
    --danger: #ffb4ab;
    --panel: #1d1c22;
  }
}
* { box-sizing: border-box; }
body {
  margin: 0;
  background: var(--bg);
  color: var(--fg);
  font: 1rem/1.5 system-ui, -apple-system, "Segoe UI", sans-serif;
}
main { max-width: 34rem; margin: 0 auto; padding: 2rem 1rem; overflow-wrap: anywhere; } /* a long word breaks */
h1 { font-size: 1.5rem; line-height: 1.25; margin: 0 0 1rem; }
p, fieldset, pre { margin: 0 0 1rem; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: .9rem; }
pre {
  background: var(--panel);
  border: 1px solid var(--line);
  border-radius: .5rem;
  padding: .75rem;
  white-space: pre-wrap;
}
/* a new token: one click or tap takes it whole, and it breaks anywhere, not at a hyphen of its own */
.token { user-select: all; -webkit-user-select: all; word-break: break-all; }
.muted { color: var(--muted); }
.error { border-left: 4px solid #d93025; padding: .25rem .75rem; }
.warning { border-left: 4px solid #f29900; padding: .25rem .75rem; }
.notice { border-left: 4px solid var(--accent); padding: .25rem .75rem; }
h1 .logo, h2 .logo { vertical-align: middle; margin-right: .5rem; }
fieldset { border: 1px solid var(--line); border-radius: .5rem; padding: .75rem 1rem; background: var(--panel); }
legend { padding: 0 .25rem; font-weight: 600; }
label { display: block; padding: .5rem 0; }
.bar {
  display: flex;
  flex-wrap: wrap;
  justify-content: space-between;
  align-items: center;
  gap: 1rem;
  margin: 0 0 1rem;
}
.bar button { width: auto; padding: .4rem .8rem; font-weight: 400; }
input[type=password],
input[type=url],
input:not([type]) {
  display: block;
  width: 100%;
  margin-top: .25rem;
  padding: .6rem;
  font: inherit;
  color: inherit;
  background: var(--panel);
  border: 1px solid var(--field);
  border-radius: .4rem;
}
::placeholder { color: var(--muted); }
.actions { display: flex; flex-wrap: wrap; gap: .75rem; margin: 1.25rem 0 1rem; }
[hidden] { display: none !important; }
.passkey { border-top: 1px solid var(--line); padding-top: .5rem; }
.passkey h3 { font-size: 1rem; margin: 0 0 .25rem; }
.actions > * { flex: 1 1 6rem; }
button {
  width: 100%;
  padding: .7rem 1rem;
  font: inherit;
  font-weight: 600;
  border-radius: .4rem;
  border: 1px solid var(--accent);
  background: transparent;
  color: var(--accent);
  cursor: pointer;
}
button.primary { background: var(--accent); color: var(--bg); }
button.danger { border-color: var(--danger); color: var(--danger); }
/* no button is there in a page's first moments: see STYLESHEET in server.ts */
.no-enter { visibility: hidden; position: absolute; width: 0; height: 0; padding: 0; border: 0; }
button { animation: arm .6s; }
@keyframes arm { from, to { visibility: hidden; } }
select {
  font: inherit;
  color: inherit;
  background: var(--panel);
  border: 1px solid var(--field);
  border-radius: .4rem;
  padding: .4rem;
  margin-left: .25rem;
  max-width: 100%;
}
.app, .maker, .passkeys {
  border: 1px solid var(--line);
  border-radius: .5rem;
  padding: .75rem 1rem;
  margin: 0 0 1rem;
  background: var(--panel);
}
.app h2, .maker h2, .passkeys h2 { font-size: 1.1rem; margin: 0 0 .5rem; }
.logo { border-radius: .5rem; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .2rem .75rem; margin: 0 0 .75rem; }
dt { color: var(--muted); }
dd { margin: 0; min-width: 0; }
/* a small phone zoomed in: each term above what it names */
@media (max-width: 20rem) { dl { grid-template-columns: 1fr; } dd { margin-bottom: .4rem; } }
a { color: var(--accent); }
:focus-visible { outline: 3px solid var(--accent); outline-offset: 2px; }
`

/**
 * The one script Latch serves, for the passkey buttons of the sign-in, consent and apps pages. A
 * button shows only where the browser has WebAuthn; pressed, it asks Latch for a challenge, lets
 * the browser make or use a passkey, puts the answer in hidden fields of the button's own form,
 * and sends that form. Binary values travel in base64url, both ways.
 */
const PASSKEY_SCRIPT = `'use strict'
const encode = (buffer) =>
  btoa(String.fromCharCode(...new Uint8Array(buffer))).replaceAll('+', '-').replaceAll('/', '_').replaceAll('=', '')
const decode = (text) => Uint8Array.from(atob(text.replaceAll('-', '+').replaceAll('_', '/')), (c) => c.charCodeAt(0))

async function usePasskey(button) {
  const form = button.form
  const name = form.elements.namedItem('name')
  if (name !== null && !name.reportValidity()) return
  const body = new URLSearchParams({ csrf: form.elements.namedItem('csrf').value, purpose: button.dataset.passkey })
  const request = form.elements.namedItem('request')
  if (request !== null) body.set('request', request.value)
  const answer = await fetch(button.dataset.challenge, { method: 'POST', body })
  const options = await answer.json()
  if (!answer.ok) throw new Error(options.error_description)
  options.challenge = decode(options.challenge)
  const fields = {}
  if (button.dataset.passkey === 'register') {
    options.user.id = decode(options.user.id)
    for (const credential of options.excludeCredentials) credential.id = decode(credential.id)
    const { rawId, response } = await navigator.credentials.create({ publicKey: options })
    fields.credential = encode(rawId)
    fields.client_data = encode(response.clientDataJSON)
    fields.attestation = encode(response.attestationObject)
  } else {
    const { rawId, response } = await navigator.credentials.get({ publicKey: options })
    fields.credential = encode(rawId)
    fields.client_data = encode(response.clientDataJSON)
    fields.authenticator_data = encode(response.authenticatorData)
    fields.signature = encode(response.signature)
    if (response.userHandle) fields.user_handle = encode(response.userHandle)
  }
  if (button.name) fields[button.name] = button.value
  for (const [name, value] of Object.entries(fields)) {
    const input = document.createElement('input')
    Object.assign(input, { type: 'hidden', name, value })
    form.append(input)
  }
  form.noValidate = true // the password field may stay empty
  form.requestSubmit()
}

if (window.PublicKeyCredential) {
  for (const note of document.querySelectorAll('[data-passkey-missing]')) note.hidden = true
  for (const part of document.querySelectorAll('[data-passkey-only]')) part.hidden = false // a passkey's name
  for (const button of document.querySelectorAll('button[data-passkey]')) {
    const status = document.createElement('p')
    Object.assign(status, { className: 'error', role: 'alert', hidden: true })
    button.closest('.actions').before(status)
    button.hidden = false
    button.addEventListener('click', () => {
      button.disabled = true
      status.hidden = true
      usePasskey(button)
        .catch((err) => {
          status.textContent = 'The passkey did not work: ' + err.message
          status.hidden = false
        })
        .finally(() => {
          button.disabled = false
          if (document.activeElement === document.body) button.focus() // disabled, it had lost focus
        })
    })
    // Pressed, by a click or by Enter where it is the first button, it uses a passkey rather than
    // send the form as it is; and so does Enter in a form without a button of its own (a name)
    button.form.addEventListener('submit', (event) => {
      if (button.form.elements.namedItem('client_data') !== null) return // the passkey's answer
      if (event.submitter === button) return event.preventDefault()
      if (event.submitter !== null) return // another button: Approve, Deny, Sign in
      event.preventDefault()
      button.click()
    })
  }
}
`

const PAGE_POLICY = [
  "default-src 'none'",
  `style-src 'sha256-${hash('sha256', STYLESHEET, 'base64')}'`,
  'img-src data:',
  "frame-ancestors 'none'",
  "base-uri 'none'",
].join('; ')

const PAGE_HEADERS = {
  'Content-Type': 'text/html; charset=utf-8',
  'Content-Security-Policy': PAGE_POLICY,
  'X-Frame-Options': 'DENY',
  'Referrer-Policy': 'no-referrer',
  'X-Content-Type-Options': 'nosniff',
  ...NO_STORE,
}

/**
 * The policy of a page with a passkey button: it may run `/passkey.js`, by its full URL, and that
 * script may fetch `/passkeys/challenge`; nothing else. Other pages keep the policy above.
 */
function passkeyPageHeaders(config: Config, scripted: boolean): Record<string, string> {
  if (!scripted) return {}
  const script = endpointUrl(config, '/passkey.js')
  const challenge = endpointUrl(config, '/passkeys/challenge')
  return { 'Content-Security-Policy': `${PAGE_POLICY}; script-src ${script}; connect-src ${challenge}` }
}

/** A length of time, exactly, in the largest unit that divides it: `30 days`, `36 hours`, `90 seconds`. */
function formatPeriod(seconds: number): string {
  const [size, unit] = PERIOD_UNITS.find(([size]) => seconds % size === 0) ?? [1, 'second']
  return countOf(seconds / size, unit)
}

/** A count and its noun, plural but for one: `1 app`, `3 apps`, `0 live codes`. */
function countOf(count: number, noun: string): string {
  return `${count} ${noun}${count === 1 ? '' : 's'}`
}

const PERIOD_UNITS: [number, string][] = [
  [86400, 'day'],
  [3600, 'hour'],
  [60, 'minute'],
]

/** A time as people read it: `2027-01-01 12:00 UTC`. */
function formatTime(ms: number): string {
  return `${new Date(ms).toISOString().slice(0, 16).replace('T', ' ')} UTC`
}

/** Escapes text for HTML element content and double-quoted attributes. */
export function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, (char) => `&#${char.charCodeAt(0)};`)
}

/** Text a stranger chose, as plain text, escaped and isolated: whatever its direction, it cannot reorder the page. */
function isolate(text: string): string {
  return `<bdi>${escapeHtml(plainText(text))}</bdi>`
}

function renderPage(title: string, body: string, head = ''): string {
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>${escapeHtml(title)}</title>
<style>${STYLESHEET}</style>${head === '' ? '' : `\n${head}`}
</head>
<body>
<main>
${body}
</main>
</body>
</html>
`
}

/** Headers of a page: `Set-Cookie` may be several. */
type PageHeaders = Record<string, string | string[]>

function sendPage(res: ServerResponse, status: number, html: string, headers: PageHeaders = {}): void {
  closeIfBodyUnread(res)
  res.writeHead(status, { ...PAGE_HEADERS, 'Content-Length': String(Buffer.byteLength(html)), ...headers })
  res.end(html)
}

/**
 * Sends an error as a page that names the problem; used where a person, not a client, reads it:
 * one an app sent to sign in, or the owner on a form of their own (`ownersForm`).
 */
function sendErrorPage(res: ServerResponse, err: OAuthError, ownersForm = false): void {
  const words = (ownersForm ? OWNER_ERROR_PAGE_WORDS[err.status] : undefined) ?? ERROR_PAGE_WORDS[err.status]
  const [title, next] = words ?? ERROR_PAGE_WORDS[400]
  const detail = err.error === NO_ERROR_CODE ? `HTTP ${err.status}` : `${err.error}, HTTP ${err.status}`
  const body = [
    `<h1>${escapeHtml(title)}</h1>`,
    `<p>${escapeHtml(next)}</p>`,
    `<p class="error">${escapeHtml(err.message)}</p>`,
    `<p class="muted">Technical detail: <code>${escapeHtml(detail)}</code></p>`,
  ].join('\n')
  sendPage(res, err.status, renderPage(title, body), err.headers)
}

/** What an error page says to the person first, by status: a title, and what to do next. */
const ERROR_PAGE_WORDS: Record<number, [string, string]> = {
  400: ['This sign-in cannot continue', 'Go back to the app you came from and start again.'],
  403: ['This was refused', 'The line below says why, and what to do.'],
  404: ['There is nothing here', 'Check the address, or start from the home page of this server.'],
  405: ['This page cannot be used that way', 'Go back and follow a link or a button of this server.'],
  414: ['This address is too long', 'Go back to the app you came from and start again.'],
  421: ['This is not the name of this server', 'Use the address this server was set up with.'],
  429: ['Too many attempts', 'Wait, then try again.'],
  500: ['Something went wrong', 'Try again in a moment. If it goes on, the server log says why.'],
}

/** What an error page says instead on the owner's own forms (apps, tokens, passkeys), to which no app sent them. */
const FORM_REFUSED: [string, string] = [
  'This form cannot be used',
  'Go back and correct what the line below names; if the page is an old one, reload your apps page first.',
]
const OWNER_ERROR_PAGE_WORDS: Record<number, [string, string]> = {
  400: FORM_REFUSED,
  413: FORM_REFUSED,
  414: ['This address is too long', 'Start again from your apps page.'],
}

/** Whether a path is one of the owner's pages or forms, as opposed to the sign-in an app asked for. */
function isOwnersForm(path: string): boolean {
  return /^\/(apps|passkeys|sign-in|sign-out)(\/|-|$)/.test(path)
}

/**
 * The password field, with the message of a failed attempt right above it. Beside it, hidden,
 * the one user name there is, `ME`: a password manager keeps a password under its form's user
 * name, and tells one account on a host from another by it (as the Chromium project advises
 * for forms that ask only for a password). Latch reads no `username` field.
 */
function renderPasswordField(config: Config, message: string | undefined, autofocus = true): string {
  const focus = autofocus ? ' autofocus' : ''
  const input = `type="password" name="password" autocomplete="current-password" required${focus}`
  const username = `<input type="text" name="username" autocomplete="username" value="${escapeHtml(config.me)}" hidden>`
  if (message === undefined) return `${username}\n<label>Password<input ${input}></label>`
  return `${username}\n<p class="error" id="password-error" role="alert">${escapeHtml(message)}</p>
<label>Password<input ${input} aria-invalid="true" aria-describedby="password-error"></label>`
}

// --- Cookies --------------------------------------------------------------------
// Two cookies, both HttpOnly and SameSite=Lax, and Secure on an https issuer: the browser's CSRF
// value, and the owner's session. Both are Priority=High, which Chromium keeps when a page
// elsewhere on the site (another port, or a sibling host of the same registrable domain) floods
// it with ordinary cookies past the 180 it keeps for a site. On https both take the `__Host-`
// prefix, which binds them to this host and the path `/`. Cookies ignore ports, though: a page
// on another port of the same host can set a cookie of the same name, and its form posts count
// as same-site. So the hidden `csrf` field of a signed-in owner's forms is not
// the cookie's value but a token derived from the session cookie, which no page can read
// (HttpOnly) nor derive without it; forms of someone not signed in carry the CSRF cookie's value
// (double submit), and approve only with the password or a passkey.

/**
 * Up to `max` values of the cookies of one name, in the order the browser sent them. A page on
 * another port of this host can set a cookie of the same name (browsers do not keep ports
 * apart) for a longer path, and the browser then sends that one first.
 */
function readCookies(req: IncomingMessage, name: string, max: number, wellFormed = /./): string[] {
  const values: string[] = []
  for (const pair of (req.headers.cookie ?? '').split(';')) {
    const equals = pair.indexOf('=')
    if (equals === -1 || pair.slice(0, equals).trim() !== name) continue
    const value = pair.slice(equals + 1).trim()
    if (wellFormed.test(value) && values.push(value) === max) break
  }
  return values
}

function csrfCookieName(config: Config): string {
  return cookieName('latch_csrf', config)
}

function sessionCookieName(config: Config): string {
  return cookieName('latch_session', config)
}

/**
 * A cookie's name: on https, with the `__Host-` prefix, whose cookies must have `Path=/`. So two
 * Latches under two paths of one https host (`/alice` and `/bob`) would share them, and signing
 * in to one would sign out of the other: an issuer with a path adds a few characters of its own,
 * from the path's hash.
 */
function cookieName(base: string, config: Config): string {
  if (!config.issuer.startsWith('https:')) return base // the cookie's Path is the issuer's
  let suffix = cookieSuffixes.get(config)
  if (suffix === undefined) {
    const path = new URL(config.issuer).pathname.replace(/\/$/, '')
    suffix = path === '' ? '' : `-${hash('sha256', path, 'base64url').slice(0, 8)}`
    cookieSuffixes.set(config, suffix)
  }
  return `__Host-${base}${suffix}`
}

/** Each configuration's cookie-name suffix, made once rather than at every request. */
const cookieSuffixes = new WeakMap<Config, string>()

/** A Set-Cookie value; `maxAgeSeconds` undefined makes a cookie that ends with the browser session. */
function buildCookie(name: string, value: string, maxAgeSeconds: number | undefined, config: Config): string {
  const issuer = new URL(config.issuer)
  const path = name.startsWith('__Host-') ? '/' : `${issuer.pathname.replace(/\/$/, '')}/`
  const maxAge = maxAgeSeconds === undefined ? '' : `; Max-Age=${maxAgeSeconds}`
  const secure = issuer.protocol === 'https:' ? '; Secure' : ''
  return `${name}=${value}; Path=${path}${maxAge}; HttpOnly; SameSite=Lax; Priority=High${secure}`
}

/** The browser's CSRF cookie, set again with the value its pages carry; it ends with the browser session. */
function csrfCookie(visitor: Visitor, config: Config): string {
  return buildCookie(csrfCookieName(config), visitor.csrf, undefined, config)
}

/** The session cookie, emptied: the browser forgets it at once. */
function endedSessionCookie(config: Config): string {
  return buildCookie(sessionCookieName(config), '', 0, config)
}

/**
 * Who is at the browser: its CSRF value, the owner's session if any and when it signed in, and
 * whether approving needs no password.
 */
type Visitor = {
  csrf: string
  session: string | undefined
  signedInAt: number | undefined
  signedIn: boolean
  /** Signed in with the password held before: a new `PASSWORD_HASH` ended the session. */
  oldPassword?: boolean
}

/** Reads the visitor of a page. The CSRF value is the browser's own when it has one, so two open tabs both work. */
async function readVisitor(req: IncomingMessage, ctx: Context): Promise<Visitor> {
  const csrf = readCsrfCookies(req, ctx.config)[0] ?? createSecret()
  const found = await findOwnerSession(req, ctx)
  const { session, signedInAt } = found
  const signedIn = ctx.config.passwordHash === undefined || session !== undefined
  return { csrf, session, signedInAt, signedIn, oldPassword: 'oldPassword' in found }
}

/** The value a visitor's forms carry in their `csrf` field: derived from the session when signed in. */
function formToken(visitor: Pick<Visitor, 'csrf' | 'session'>): string {
  return visitor.session === undefined ? visitor.csrf : hash('sha256', `latch form ${visitor.session}`, 'base64url')
}

/**
 * Checks the `csrf` field of a form posted from one of Latch's pages: with a live session it must
 * be the session's token, and otherwise the browser's CSRF cookie; and a browser that says where
 * the form came from (`Sec-Fetch-Site`) must say this origin. Returns the visitor it names. A
 * form that this origin sent with a value that no longer fits is a page left open while the
 * owner signed in or out: a 403 that says so, not a forgery. But a form that `signsIn` (with a
 * password or a passkey's answer), made while signed out and sent after another tab signed in,
 * is taken as signed out, as it was made: whoever sends it must sign in all the same.
 */
async function requireFormToken(
  form: Params,
  req: IncomingMessage,
  ctx: Context,
  { signsIn = false } = {},
): Promise<Visitor> {
  // sent by browsers since 2023: a form of this server's own pages is same-origin
  const site = req.headers['sec-fetch-site']
  const sent = site === undefined || site === 'same-origin' ? getParam(form, 'csrf') : undefined
  const cookies = readCsrfCookies(req, ctx.config)
  const fromCookie = cookies.find((cookie) => sent !== undefined && safeEqual(sent, cookie))
  // a form that signs in, made while signed out, is taken as signed out whatever the session, when
  // the browser says it is this origin's (not an old browser, nor a page on another port)
  const madeSignedOut = signsIn && fromCookie !== undefined && site === 'same-origin'
  const { session, signedInAt } = madeSignedOut ? NO_SESSION : await findOwnerSession(req, ctx)
  // signed out, the form carries one of the browser's CSRF cookies; signed in, the session's token
  const csrf = session === undefined ? fromCookie : (cookies[0] ?? '')
  const visitor = {
    csrf: csrf ?? '',
    session,
    signedInAt,
    signedIn: ctx.config.passwordHash === undefined || session !== undefined,
  }
  if (sent === undefined || csrf === undefined || !safeEqual(sent, formToken(visitor))) {
    // the browser says a page of this server sent it: one made before the owner signed in or out
    if (site === 'same-origin' && sent !== undefined) {
      const stale =
        cookies.length === 0
          ? `Your browser sent no cookie with this form: allow cookies for ${new URL(ctx.config.issuer).hostname}, ` +
            'then reload the page and try again'
          : 'This page is out of date: you signed in or out, or your session ended, since it was opened. ' +
            'Go back, reload it and try again'
      throw new OAuthError('access_denied', stale)
    }
    const sentTo = `${mountPath(ctx.config)}${pathOf(req.url ?? '/')}` // as the request's own log line says
    // a page of this server opened under another name (a proxy's, an address): reloading it cannot
    // help. Any site can send a form, so only a name of this machine is offered as one for ISSUER.
    // Latch's pages send no Referer, so a browser says `Origin: null` for theirs: then only
    // Sec-Fetch-Site tells that the page was elsewhere, and not where.
    const origin = req.headers.origin ?? ''
    const issuer = new URL(ctx.config.issuer).origin
    const named = /^https?:\/\/[\w.:[\]-]{1,300}$/.test(origin) && URL.canParse(origin) && origin !== issuer
    const elsewhere = named || site === 'same-site' || site === 'cross-site'
    const local = named && LOOPBACK_HOSTS.has(unbracketed(new URL(origin).hostname))
    throw new OAuthError(
      'access_denied',
      elsewhere
        ? `This form was sent from a page at ${named ? origin : 'another address'}, but this server is at ` +
            `${issuer}: start again from the app, or open the page at ${issuer}` +
            (local ? ', or set ISSUER to the address you use' : '')
        : 'This form was not sent from a page of this server in this browser: go back, reload the page and try again',
      {
        event: `a form sent to ${sentTo} was refused: it did not come from this server's page`,
      },
    )
  }
  return visitor
}

/**
 * Ends every session the browser names, at a sign-in: not only the one it was signed in with,
 * which a new one replaces.
 */
async function endSessionsNamed(req: IncomingMessage, ctx: Context): Promise<void> {
  await Promise.all(readSessionCookies(req, ctx.config).map((value) => ctx.store.deleteSession(hashSecret(value))))
}

/** Whether a form signs in: it carries a password, or a passkey's answer. */
function signsIn(form: Params): boolean {
  return form.has('password') || form.has('credential')
}

/** Like `requireFormToken`, for what only the signed-in owner may do: a 403 to anyone else. */
async function requireOwner(form: Params, req: IncomingMessage, ctx: Context): Promise<Visitor> {
  const visitor = await requireFormToken(form, req, ctx)
  if (!visitor.signedIn) {
    const ended = 'You are not signed in (your session has ended): sign in again on your apps page, then try again'
    throw new OAuthError('access_denied', ended)
  }
  return visitor
}

/**
 * The browser's CSRF cookies, well formed: its own, and any a page on another port of this host
 * planted for a longer path, which the browser sends first. Any of them may be the one a form
 * carries; a planted one proves nothing, but a page that can plant one can replace ours anyway.
 */
function readCsrfCookies(req: IncomingMessage, config: Config): string[] {
  return readCookies(req, csrfCookieName(config), MAX_COOKIES_OF_A_NAME, SECRET_FORMAT)
}

/**
 * The value of the browser's session cookie when it names a live session started with the
 * current password, and when that sign-in was: a new `PASSWORD_HASH` ends every session made
 * with the old one.
 */
async function findOwnerSession(
  req: IncomingMessage,
  ctx: Context,
): Promise<
  { session: string; signedInAt: number } | { session: undefined; signedInAt: undefined; oldPassword?: boolean }
> {
  if (ctx.config.passwordHash === undefined) return NO_SESSION
  // any cookie of the name: those planted by other pages on this host must not sign the owner out;
  // looked up all at once, as a store across a network would otherwise take a round trip for each
  const values = readSessionCookies(req, ctx.config)
  const now = ctx.now()
  const sessions = await Promise.all(values.map((value) => ctx.store.findSession(hashSecret(value), now)))
  const tag = passwordTag(ctx.config.passwordHash)
  // a session of an old password is ignored, not deleted here: a read writes nothing, and it
  // expires; so is one older than SESSION_TTL, which may have been made shorter since
  const current = (session: Session | undefined): session is Session =>
    session !== undefined && session.createdAt + ctx.config.sessionTtlSeconds * 1000 > now
  for (const [i, session] of sessions.entries())
    if (current(session) && session.passwordTag === tag) return { session: values[i], signedInAt: session.createdAt }
  return sessions.some(current) ? OLD_PASSWORD : NO_SESSION // live, and of another password
}

const NO_SESSION = { session: undefined, signedInAt: undefined }
/** No session, but the browser's was made with the password `PASSWORD_HASH` held before: the sign-in page says so. */
const OLD_PASSWORD = { session: undefined, signedInAt: undefined, oldPassword: true }

function readSessionCookies(req: IncomingMessage, config: Config): string[] {
  const name = sessionCookieName(config)
  const most = name.startsWith('__Host-') ? MAX_HOST_COOKIES_OF_A_NAME : MAX_COOKIES_OF_A_NAME
  return readCookies(req, name, most, SECRET_FORMAT)
}

/**
 * The most cookies of one name read from one request: the browser's own, and, on http, what other
 * pages could plant, one for each domain from this host up that matches, each path and each
 * partition, which on a host of many labels makes dozens. node:http's 16 KiB of headers holds
 * about 280: the bound matters where an app lets in more, since each session cookie costs a hash
 * and a store lookup.
 */
const MAX_COOKIES_OF_A_NAME = 300

/**
 * On https, the `__Host-` prefix allows no cookie of the name for another domain or path: the
 * browser's own, and one partitioned, which a page on another port may set, and a few to spare.
 * More are a stranger's own, each a store lookup it would cost.
 */
const MAX_HOST_COOKIES_OF_A_NAME = 4

/** What a session keeps of the password it was started with: enough to tell a new one, nothing to guess it by. */
function passwordTag(passwordHash: string): string {
  return hashSecret(`latch session ${passwordHash}`)
}

/** Starts a session for the owner and returns its Set-Cookie value. */
async function startSession(ctx: Context): Promise<string> {
  const value = createSecret()
  const now = ctx.now()
  const ttl = ctx.config.sessionTtlSeconds
  const session = {
    createdAt: now,
    expiresAt: now + ttl * 1000,
    passwordTag: passwordTag(ctx.config.passwordHash ?? ''),
  }
  await ctx.store.saveSession(hashSecret(value), session, now)
  return buildCookie(sessionCookieName(ctx.config), value, ttl, ctx.config)
}

// --- Sign-in checks -------------------------------------------------------------
// A sign-in is the password or a passkey. Attempts are counted before the password's hash or the
// passkey's signature is checked, so guesses sent in parallel count too: per client address,
// where five are free, the password's and the passkey's together; and passwords in total, where
// twenty are, against guesses spread over many addresses. Each attempt past those is still
// checked but makes the next wait, 2 seconds, then twice as long each time, up to 15 minutes (429
// with Retry-After); a success clears the counts, and a day of quiet forgets them. A passkey
// cannot be guessed, so it is kept out of the total: there, strangers' failures would only lock
// the owner out of the one sign-in they cannot break; nor does its success clear the total. An
// answer that names no passkey stored here is not counted at all (`refuseUnknownPasskey`). At most
// two scrypt checks run at once, so a flood cannot pin the CPU.

const FREE_ATTEMPTS_PER_ADDRESS = 5
const FREE_ATTEMPTS_IN_TOTAL = 20
const MAX_PASSWORD_DELAY_SECONDS = 900
const FORGET_PASSWORD_FAILURES_SECONDS = 86400
const FORGIVE_ATTEMPT_MS = 3_600_000
const MAX_TRACKED_ADDRESSES = 10_000
const MAX_PARALLEL_PASSWORD_CHECKS = 2
const MAX_WAITING_PASSWORD_CHECKS = 32

/**
 * Why a sign-in is refused, for the form shown again: a wrong or missing password, or a passkey
 * refused (401, as the wire contract answers a consent's), password sign-in turned off (403), or
 * too many wrong ones (429).
 */
type SignInRefusal = { status: 401 | 403 | 429; message: string; headers: Record<string, string> }

/**
 * The challenge a 401 must carry (RFC 9110 §15.5.2), for a sign-in that is a form on the page:
 * no browser knows the scheme, so none asks in a dialog of its own; it shows the page, whose form
 * is the way to authenticate.
 */
function formChallenge(config: Config): Record<string, string> {
  return { 'WWW-Authenticate': `Form realm="${config.issuer}"` }
}

/**
 * Checks the owner's sign-in on a form: the password, or a passkey's answer to a challenge made
 * for this browser (and for this pending request, on a consent page). A password counts per
 * address and in total; a passkey stored here, per address only; an answer naming none, not at
 * all. Returns undefined when it is right, else why it is refused.
 */
async function checkSignIn(
  form: Params,
  on: { visitor: Visitor; request?: string },
  req: IncomingMessage,
  res: ServerResponse,
  ctx: Context,
): Promise<SignInRefusal | undefined> {
  const address = clientAddress(req, ctx.trustedProxies)
  const group = addressGroup(address) // an IPv6 /64 is one host's: its addresses share their tries
  const attempts = ctx.signInAttempts
  const byPasskey = getParam(form, 'credential') !== undefined
  const password = getParam(form, 'password')
  // a passkey answer is looked up first: one that names no passkey stored here checks no secret, and
  // is refused before it is counted or uses up its challenge (a stranger knows no passkey's id)
  const unknown = byPasskey ? await refuseUnknownPasskey(form, ctx) : undefined
  if (unknown !== undefined) return { status: 401, message: unknown, headers: formChallenge(ctx.config) }
  // from the lock's check to the count, nothing is awaited: answers sent in parallel see each other's counts
  const now = ctx.steadyNow()
  const lockedUntil = () =>
    Math.max(attempts.byAddress.get(group)?.lockedUntil ?? 0, byPasskey ? 0 : attempts.total.lockedUntil)
  const locked = lockedUntil()
  if (locked > now) {
    const retryAfter = Math.ceil((locked - now) / 1000)
    noteError(res, 'too_many_requests')
    const wait = countOf(retryAfter, 'second')
    const message = `Too many ${byPasskey ? 'failed sign-ins' : 'wrong passwords'}: try again in ${wait}`
    return { status: 429, message, headers: { 'Retry-After': String(retryAfter) } }
  }
  if (!byPasskey && !ctx.config.passwordSignIn)
    return { status: 403, message: 'Password sign-in is off: sign in with a passkey', headers: {} }
  if (!byPasskey && password === undefined)
    return { status: 401, message: 'Enter your password', headers: formChallenge(ctx.config) }
  const previous = attempts.byAddress.get(group)
  attempts.byAddress.delete(group) // re-inserted last, so the map stays ordered oldest first
  if (attempts.byAddress.size >= MAX_TRACKED_ADDRESSES)
    attempts.byAddress.delete(attempts.byAddress.keys().next().value ?? '')
  attempts.byAddress.set(group, countAttempt(previous, now, FREE_ATTEMPTS_PER_ADDRESS))
  if (!byPasskey) attempts.total = countAttempt(attempts.total, now, FREE_ATTEMPTS_IN_TOTAL)
  const passwordHash = ctx.config.passwordHash ?? ''
  const refused = byPasskey
    ? await checkPasskeySignIn(form, on, address, ctx)
    : (await withPasswordSlot(ctx.passwordSlots, () => verifyPassword(password ?? '', passwordHash)))
      ? undefined
      : 'Wrong password'
  if (refused !== undefined) {
    const wait = lockedUntil() - now
    if (wait > 0) {
      const from = !byPasskey && attempts.total.lockedUntil - now === wait ? 'in total' : `from ${group}`
      logEvent(
        ctx,
        'security',
        `too many ${byPasskey ? 'failed passkey sign-ins' : 'wrong passwords'} ${from}: ` +
          `the next attempt must wait ${wait / 1000} seconds`,
        address,
      )
    }
    return { status: 401, message: refused, headers: formChallenge(ctx.config) }
  }
  attempts.byAddress.delete(group)
  if (!byPasskey) attempts.total = NO_ATTEMPTS // a passkey proves the owner, not that strangers stopped guessing
  return undefined
}

const NO_ATTEMPTS: PasswordAttempts = { count: 0, lastAt: 0, lockedUntil: 0 }

/**
 * One more attempt: free up to `free`, then locked for 2, 4, 8, … seconds, up to 15 minutes. An
 * hour without one forgives one (half an hour, half of one), so that the guesses every server
 * meets now and then do not add up, over weeks, to a lock at each; a day without forgets them all.
 */
export function countAttempt(previous: PasswordAttempts | undefined, now: number, free: number): PasswordAttempts {
  const quiet = previous === undefined ? Infinity : now - previous.lastAt
  // forgiven in part too: a guess every half hour adds up half as fast
  const left = quiet > FORGET_PASSWORD_FAILURES_SECONDS * 1000 ? 0 : (previous?.count ?? 0) - quiet / FORGIVE_ATTEMPT_MS
  const count = Math.max(0, left) + 1
  const over = Math.ceil(count) - free
  const delaySeconds = over <= 0 ? 0 : Math.min(2 ** over, MAX_PASSWORD_DELAY_SECONDS)
  return { count, lastAt: now, lockedUntil: now + delaySeconds * 1000 }
}

/** Runs a password check when one of the few slots is free; past the queue's length, 429. */
export function withPasswordSlot<T>(slots: PasswordSlots, check: () => Promise<T>): Promise<T> {
  const busy = () =>
    new OAuthError('too_many_requests', 'The server is busy checking passwords: try again in a few seconds', {
      headers: { 'Retry-After': '5' },
    })
  return withSlot(slots, PASSWORD_CHECK_SLOTS, busy, check)
}

const PASSWORD_CHECK_SLOTS = { running: MAX_PARALLEL_PASSWORD_CHECKS, waiting: MAX_WAITING_PASSWORD_CHECKS }

// --- Owner password -------------------------------------------------------------
// The owner's password is stored as `scrypt:ln=15,r=8,p=1:<salt>:<hash>` (base64url): the
// string carries its own salt and cost, and has no `$` for a shell to expand.

const SCRYPT_KEY_LENGTH = 32
const SCRYPT_DEFAULT_COST = { ln: 15, r: 8, p: 1 }

type PasswordHash = { ln: number; r: number; p: number; salt: Buffer; hash: Buffer }

/** Hashes a password with scrypt and a random salt; `ln` is log2 of the cost N. */
export async function hashPassword(
  password: string,
  cost: { ln: number; r: number; p: number } = SCRYPT_DEFAULT_COST,
): Promise<string> {
  const salt = randomBytes(16)
  const hash = await runScrypt(password, { ...cost, salt })
  return `scrypt:ln=${cost.ln},r=${cost.r},p=${cost.p}:${base64url(salt)}:${base64url(hash)}`
}

/** Checks a password against a hash from `hashPassword`, comparing in constant time. */
export async function verifyPassword(password: string, passwordHash: string): Promise<boolean> {
  const parsed = parsePasswordHash(passwordHash)
  if (parsed === undefined) return false
  const hash = await runScrypt(password, parsed)
  return timingSafeEqual(hash, parsed.hash)
}

/**
 * A hash's cost must be one this machine can pay for every wrong password a stranger sends, two
 * at a time: at most 256 MiB of work, 128 · 2^ln · r · p bytes (scrypt's memory is 128 · 2^ln · r
 * bytes, gone through p times; 2^17 with r=8 and p=1, OWASP's advice, is 128 MiB). And at least
 * ln=10 with r=8 (the tests' cost): less makes each guess nearly free.
 */
function parsePasswordHash(value: string): PasswordHash | undefined {
  const match = PASSWORD_HASH_FORMAT.exec(value)
  // a 16-byte salt and a 32-byte key, as `hashPassword` makes them (`passwordHashProblem`)
  if (match === null || match[4].length !== 22 || match[5].length !== 43) return undefined
  const [ln, r, p] = [Number(match[1]), Number(match[2]), Number(match[3])]
  if (ln < 10 || r < 8 || r > 16 || p < 1 || p > 4 || 128 * 2 ** ln * r * p > MAX_SCRYPT_BYTES) return undefined
  return { ln, r, p, salt: Buffer.from(match[4], 'base64url'), hash: Buffer.from(match[5], 'base64url') }
}

const MAX_SCRYPT_BYTES = 256 * 2 ** 20

/** `scrypt:ln=…,r=…,p=…:<salt>:<key>`, salt and key of any length, so that one cut short can be told. */
const PASSWORD_HASH_FORMAT = /^scrypt:ln=(\d+),r=(\d+),p=(\d+):([A-Za-z0-9_-]+):([A-Za-z0-9_-]*)$/

function runScrypt(password: string, params: { ln: number; r: number; p: number; salt: Buffer }): Promise<Buffer> {
  const N = 2 ** params.ln
  const maxmem = 128 * N * params.r * params.p + 1024 * 1024
  return new Promise((resolve, reject) => {
    scrypt(
      password.normalize('NFC'),
      params.salt,
      SCRYPT_KEY_LENGTH,
      { N, r: params.r, p: params.p, maxmem },
      (err, key) => {
        if (err) reject(err)
        else resolve(key)
      },
    )
  })
}

// --- Passkeys (WebAuthn) --------------------------------------------------------
// WebAuthn Level 3  https://www.w3.org/TR/webauthn-3/
// A passkey is a key pair made by the owner's device: Latch keeps the public key, and signing in
// is the device signing a challenge Latch made. What arrives is three byte strings a browser hands
// over: `clientDataJSON` (what the browser saw: the challenge and the page's origin),
// `authenticatorData` (what the device says: which site, whether the person was there, a counter)
// and a signature over the authenticator data and the SHA-256 hash of the client data.
// Registration sends an `attestationObject` instead, a CBOR map that carries the authenticator
// data with the new public key in it, as a COSE key. So WebAuthn needs no library: a small CBOR
// reader, COSE keys turned into JWKs for `createPublicKey`, and the checks of the spec's two
// ceremonies (§7.1 and §7.2), each of which throws a `PasskeyError` that says which check failed.
// Latch trusts the owner, not the device's maker: an attestation statement, if the device sends
// one, is ignored.

/** A WebAuthn check that failed; its message says which, for the log and the page. */
export class PasskeyError extends Error {}

const COSE_ALGORITHMS = { ES256: -7, EdDSA: -8, RS256: -257 } as const
const SUPPORTED_ALGORITHMS: number[] = Object.values(COSE_ALGORITHMS)
const MAX_CBOR_DEPTH = 16
const MAX_CREDENTIAL_ID_BYTES = 1_023
const MAX_SIGNATURE_COUNTER = 0xffff_ffff // 32 bits
const MIN_RSA_BITS = 2_048
const MAX_RSA_BITS = 4_096
const utf8DroppingBom = new TextDecoder('utf-8', { fatal: true }) // the Encoding Standard's "UTF-8 decode"

/**
 * Reads one CBOR data item (RFC 8949 §3) at `offset`: its value and where it ends. Enough CBOR for
 * WebAuthn, whose authenticators send CTAP2's canonical form: integers, byte and text strings,
 * arrays, maps, `true`, `false`, `null`. Indefinite lengths, tags and floats never occur there,
 * and are refused, as is anything that claims more bytes than there are. That the encoding is
 * the canonical one (its map keys in order, say) is not checked: nothing here depends on it.
 * @see https://www.rfc-editor.org/rfc/rfc8949#section-3
 */
export function readCbor(bytes: Buffer, offset = 0, depth = 0): { value: unknown; end: number } {
  if (depth > MAX_CBOR_DEPTH) throw new PasskeyError(`CBOR nests deeper than ${MAX_CBOR_DEPTH}`)
  if (offset >= bytes.length) throw new PasskeyError('CBOR ends before its data item')
  const initial = bytes[offset]
  const major = initial >> 5
  const { argument, end: start } = readCborArgument(bytes, offset)
  switch (major) {
    case 0: // unsigned integer
      return { value: argument, end: start }
    case 1: // negative integer: -1 - argument
      return { value: -1 - argument, end: start }
    case 2: // byte string
    case 3: {
      // or text string: a length, then that many bytes
      if (argument > bytes.length - start) throw new PasskeyError('a CBOR string runs past the end')
      const slice = bytes.subarray(start, start + argument)
      if (major === 2) return { value: Buffer.from(slice), end: start + argument }
      try {
        return { value: utf8.decode(slice), end: start + argument }
      } catch {
        throw new PasskeyError('a CBOR text string is not UTF-8')
      }
    }
    case 4: {
      // array: at least one byte per item, so a length past the end is caught before any work
      if (argument > bytes.length - start) throw new PasskeyError('a CBOR array runs past the end')
      const items: unknown[] = []
      let end = start
      for (let i = 0; i < argument; i++) {
        const item = readCbor(bytes, end, depth + 1)
        items.push(item.value)
        end = item.end
      }
      return { value: items, end }
    }
    case 5: {
      // map: keys and values in turn
      if (argument > (bytes.length - start) / 2) throw new PasskeyError('a CBOR map runs past the end')
      const map = new Map<unknown, unknown>()
      let end = start
      for (let i = 0; i < argument; i++) {
        const key = readCbor(bytes, end, depth + 1)
        if (typeof key.value !== 'number' && typeof key.value !== 'string')
          throw new PasskeyError('a CBOR map key is neither an integer nor a text string')
        if (map.has(key.value)) throw new PasskeyError('a CBOR map has a key twice')
        const value = readCbor(bytes, key.end, depth + 1)
        map.set(key.value, value.value)
        end = value.end
      }
      return { value: map, end }
    }
    case 6:
      throw new PasskeyError('CBOR tags are not used by WebAuthn')
    default: {
      // major type 7: simple values
      const simple = initial & 0x1f
      if (simple === 20) return { value: false, end: offset + 1 }
      if (simple === 21) return { value: true, end: offset + 1 }
      if (simple === 22) return { value: null, end: offset + 1 }
      throw new PasskeyError('CBOR floats and other simple values are not used by WebAuthn')
    }
  }
}

/** A data item's argument: a length, a count or an integer, in the low 5 bits or the 1 to 8 bytes after them. */
function readCborArgument(bytes: Buffer, offset: number): { argument: number; end: number } {
  const low = bytes[offset] & 0x1f
  const major = bytes[offset] >> 5
  if (major === 7) return { argument: 0, end: offset + 1 }
  if (low < 24) return { argument: low, end: offset + 1 }
  if (low === 31) throw new PasskeyError('CBOR indefinite lengths are not used by WebAuthn')
  if (low > 27) throw new PasskeyError('CBOR reserved values (28 to 30) are not well-formed') // RFC 8949 §3
  const size = 2 ** (low - 24) // 1, 2, 4 or 8 bytes
  if (offset + 1 + size > bytes.length) throw new PasskeyError('CBOR ends inside a length')
  const big = size === 8 ? bytes.readBigUInt64BE(offset + 1) : BigInt(bytes.readUIntBE(offset + 1, size))
  if (big > BigInt(Number.MAX_SAFE_INTEGER)) throw new PasskeyError('a CBOR integer is too large')
  return { argument: Number(big), end: offset + 1 + size }
}

/**
 * A COSE key (RFC 9052 §7, as a map `readCbor` made) as a node:crypto public key: each of the
 * three kinds Latch accepts becomes the JWK it is (RFC 9053 §2, §7 for EC2 and OKP keys; RFC 8230
 * §4 for RSA keys, and RFC 8812 §2 for RS256).
 * @see https://www.w3.org/TR/webauthn-3/#sctn-encoded-credPubKey-examples
 */
export function readCoseKey(cose: unknown): { key: KeyObject; algorithm: number } {
  if (!(cose instanceof Map)) throw new PasskeyError('the public key is not a COSE key')
  const bytesAt = (label: number): Buffer => {
    const value = cose.get(label)
    if (!Buffer.isBuffer(value) || value.length === 0) throw new PasskeyError(`the COSE key lacks parameter ${label}`)
    return value
  }
  const kty = cose.get(1)
  const algorithm = cose.get(3)
  const rsaRefused = `the RSA key is not of ${MIN_RSA_BITS} to ${MAX_RSA_BITS} bits with the exponent 65537`
  let jwk: { kty: string; crv?: string; x?: string; y?: string; n?: string; e?: string }
  let modulus: Buffer | undefined // an RSA key's
  if (kty === 2 && algorithm === COSE_ALGORITHMS.ES256 && cose.get(-1) === 1) {
    jwk = { kty: 'EC', crv: 'P-256', x: base64url(bytesAt(-2)), y: base64url(bytesAt(-3)) }
  } else if (kty === 1 && algorithm === COSE_ALGORITHMS.EdDSA && cose.get(-1) === 6) {
    const x = bytesAt(-2)
    const point = x.length === 32 ? withoutSignBit(x) : undefined
    if (point !== undefined && ED25519_SMALL_ORDER.some((small) => small.equals(point)))
      throw new PasskeyError('the Ed25519 key is a point of small order, whose signatures anyone can make')
    // node:crypto takes any 32 bytes, and a key that is no point verifies nothing: a passkey that
    // could never sign in would still count as one, where it is the last left
    if (point !== undefined && !isEd25519Point(point))
      throw new PasskeyError('the Ed25519 key is not a point of the curve, so no signature could verify')
    jwk = { kty: 'OKP', crv: 'Ed25519', x: base64url(x) }
  } else if (kty === 3 && algorithm === COSE_ALGORITHMS.RS256) {
    // the lengths first: node:crypto spends time in proportion to an exponent's before it can refuse it
    const e = bytesAt(-2)
    modulus = bytesAt(-1)
    if (modulus.length > MAX_RSA_BITS / 8 + 1 || e.length > 4) throw new PasskeyError(rsaRefused)
    jwk = { kty: 'RSA', n: base64url(modulus), e: base64url(e) }
  } else {
    throw new PasskeyError('the key is not ES256 on P-256, EdDSA on Ed25519 or RS256')
  }
  let key: KeyObject
  try {
    key = createPublicKey({ key: jwk, format: 'jwk' })
  } catch {
    throw new PasskeyError('the COSE key is not a valid public key')
  }
  if (modulus !== undefined) {
    const details = key.asymmetricKeyDetails
    const bits = details?.modulusLength ?? 0
    if (bits < MIN_RSA_BITS || bits > MAX_RSA_BITS || details?.publicExponent !== 65537n)
      throw new PasskeyError(rsaRefused)
    // an even modulus has a private exponent anyone can work out (other weak moduli, a prime
    // one say, only a device made to deceive would send, and they cost more to tell)
    if (modulus[modulus.length - 1] % 2 === 0)
      throw new PasskeyError('the RSA modulus is even, so anyone can sign with the key')
  }
  return { key, algorithm }
}

/**
 * The points of small order on Ed25519, as 32 bytes with the sign bit of x cleared: a key that
 * is one of them verifies signatures made without any private key (the list libsodium refuses).
 */
const ED25519_SMALL_ORDER = [
  '0000000000000000000000000000000000000000000000000000000000000000', // y = 0, order 4
  '0100000000000000000000000000000000000000000000000000000000000000', // y = 1, the identity
  '26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05', // order 8
  'c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a', // order 8
  'ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f', // y = p - 1, order 2
  'edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f', // y = p, that is 0
  'eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f', // y = p + 1, that is 1
].map((hex) => Buffer.from(hex, 'hex'))

/** p = 2^255 - 19, and d, of Ed25519 (RFC 8032 §5.1). */
const ED25519_P = 2n ** 255n - 19n
const ED25519_D = 37095705934669439343138083508754565189542113879843219016388785533085940283555n

/**
 * Whether a key's y (32 bytes, little-endian, the sign bit of x cleared) is that of a point on
 * Ed25519, as RFC 8032 §5.1.3 decodes it: y below p, and x² = (y² - 1) / (d·y² + 1) a square
 * modulo p (Euler's criterion). Run only when a passkey is added.
 * @see https://www.rfc-editor.org/rfc/rfc8032#section-5.1.3 RFC 8032 §5.1.3
 */
function isEd25519Point(point: Buffer): boolean {
  const p = ED25519_P
  const y = BigInt(`0x${Buffer.from(point).reverse().toString('hex')}`)
  if (y >= p) return false
  const ySquared = (y * y) % p
  const xSquared = (((ySquared - 1n + p) % p) * powerModP((ED25519_D * ySquared + 1n) % p, p - 2n)) % p
  return xSquared === 0n || powerModP(xSquared, (p - 1n) / 2n) === 1n
}

/** base^exponent modulo p of Ed25519, by squaring. */
function powerModP(base: bigint, exponent: bigint): bigint {
  let result = 1n
  for (let square = base % ED25519_P, rest = exponent; rest > 0n; rest >>= 1n) {
    if ((rest & 1n) === 1n) result = (result * square) % ED25519_P
    square = (square * square) % ED25519_P
  }
  return result
}

function withoutSignBit(x: Buffer): Buffer {
  const y = Buffer.from(x)
  y[31] &= 0x7f
  return y
}

/** What the device says, in the byte layout of WebAuthn §6.1. */
export type AuthenticatorData = {
  /** SHA-256 of the RP ID the device signed for: Latch's host name. */
  rpIdHash: Buffer
  flags: { userPresent: boolean; userVerified: boolean; backupEligible: boolean; backedUp: boolean }
  counter: number
  /** At registration: the new credential, with its public key as a COSE map. */
  credential?: { aaguid: Buffer; id: Buffer; publicKey: unknown }
}

/**
 * Reads authenticator data: 32 bytes of RP ID hash, a byte of flags, a 4-byte counter, then, when
 * flag AT is set, the attested credential (16 bytes AAGUID, 2 bytes length, the id, a COSE key),
 * and when flag ED is set, a CBOR map of extensions. Nothing may follow.
 * @see https://www.w3.org/TR/webauthn-3/#sctn-authenticator-data
 */
export function readAuthenticatorData(bytes: Buffer): AuthenticatorData {
  if (bytes.length < 37) throw new PasskeyError('the authenticator data is shorter than 37 bytes')
  const flags = bytes[32]
  let end = 37
  let credential: AuthenticatorData['credential']
  if (flags & 0x40) {
    if (bytes.length < end + 18) throw new PasskeyError('the attested credential data is cut short')
    const aaguid = Buffer.from(bytes.subarray(end, end + 16))
    const length = bytes.readUInt16BE(end + 16)
    if (length === 0 || length > MAX_CREDENTIAL_ID_BYTES)
      throw new PasskeyError('the credential id is empty or longer than 1,023 bytes')
    if (bytes.length < end + 18 + length) throw new PasskeyError('the credential id is cut short')
    const id = Buffer.from(bytes.subarray(end + 18, end + 18 + length))
    const publicKey = readCbor(bytes, end + 18 + length)
    credential = { aaguid, id, publicKey: publicKey.value }
    end = publicKey.end
  }
  if (flags & 0x80) {
    const extensions = readCbor(bytes, end)
    if (!(extensions.value instanceof Map)) throw new PasskeyError('the extensions are not a CBOR map')
    end = extensions.end
  }
  if (end !== bytes.length) throw new PasskeyError('the authenticator data has bytes past its end')
  return {
    rpIdHash: Buffer.from(bytes.subarray(0, 32)),
    flags: {
      userPresent: (flags & 0x01) !== 0,
      userVerified: (flags & 0x04) !== 0,
      backupEligible: (flags & 0x08) !== 0,
      backedUp: (flags & 0x10) !== 0,
    },
    counter: bytes.readUInt32BE(33),
    credential,
  }
}

/** What a ceremony is checked against: the challenge Latch made, its origin and its RP ID. */
type CeremonyExpectations = { challenge: string; origin: string; rpId: string }

/**
 * Registration, WebAuthn §7.1: the checks of steps 7 to 25 that concern a relying party that
 * accepts any attestation (steps 22 to 24 verify a statement Latch ignores; step 25, an id of at
 * most 1,023 bytes, is in `readAuthenticatorData`). Returns the new credential; checking that its
 * id is not registered yet (step 26) and saving it (step 27) are the caller's. The step numbers
 * are those of Level 3, whose client data has `topOrigin`; earlier drafts count differently.
 * @see https://www.w3.org/TR/webauthn-3/#sctn-registering-a-new-credential
 */
export function verifyRegistration(
  response: { clientDataJSON: Buffer; attestationObject: Buffer },
  expected: CeremonyExpectations,
): { id: string; publicKey: string; algorithm: number; counter: number } {
  checkClientData(response.clientDataJSON, 'webauthn.create', expected) // steps 7 to 10
  const attestation = readCbor(response.attestationObject)
  if (!(attestation.value instanceof Map) || attestation.end !== response.attestationObject.length)
    throw new PasskeyError('the attestation object is not one CBOR map')
  const authData = attestation.value.get('authData')
  if (typeof attestation.value.get('fmt') !== 'string' || !Buffer.isBuffer(authData))
    throw new PasskeyError('the attestation object lacks fmt or authData')
  const data = readAuthenticatorData(authData) // step 12
  checkAuthenticatorData(data, expected.rpId) // steps 13 to 16, and the counter's end
  if (data.credential === undefined) throw new PasskeyError('the authenticator data carries no new credential')
  const { key, algorithm } = readCoseKey(data.credential.publicKey) // step 19: one of the algorithms offered
  return {
    id: base64url(data.credential.id),
    publicKey: base64url(key.export({ type: 'spki', format: 'der' })),
    algorithm,
    counter: data.counter,
  }
}

/**
 * Authentication, WebAuthn §7.2, steps 10 to 22: the caller has found the passkey by the id the
 * browser sent (steps 5 and 6). Returns the new signature counter, for the caller to store.
 * @see https://www.w3.org/TR/webauthn-3/#sctn-verifying-assertion
 */
export function verifyAuthentication(
  response: { clientDataJSON: Buffer; authenticatorData: Buffer; signature: Buffer },
  expected: CeremonyExpectations & { publicKey: string; algorithm: number; counter: number },
): { counter: number } {
  checkClientData(response.clientDataJSON, 'webauthn.get', expected) // steps 10 to 13
  const data = readAuthenticatorData(response.authenticatorData)
  if (data.credential !== undefined) throw new PasskeyError('a sign-in carries a new credential')
  checkAuthenticatorData(data, expected.rpId) // steps 14 to 17, and the counter's end (see step 22)
  // steps 20 and 21: the signature covers the authenticator data and the hash of the client data
  const signed = Buffer.concat([response.authenticatorData, hash('sha256', response.clientDataJSON, 'buffer')])
  let key: KeyObject
  try {
    key = createPublicKey({ key: Buffer.from(expected.publicKey, 'base64url'), format: 'der', type: 'spki' })
  } catch {
    throw new PasskeyError('the stored public key is not a valid key: remove this passkey and add it again')
  }
  const digest = expected.algorithm === COSE_ALGORITHMS.EdDSA ? null : 'sha256'
  if (!SUPPORTED_ALGORITHMS.includes(expected.algorithm) || !verifies(digest, signed, key, response.signature))
    throw new PasskeyError('the signature does not verify with the stored public key')
  // step 22: a counter that does not grow may mean that two devices hold the key, one of them a
  // clone; the spec leaves it to the server whether to refuse, and Latch does
  if ((data.counter !== 0 || expected.counter !== 0) && data.counter <= expected.counter)
    throw new PasskeyError(
      `the signature counter went from ${expected.counter} to ${data.counter}, not up: ` +
        'the passkey may have been cloned',
    )
  return { counter: data.counter }
}

/** Whether a signature verifies; a signature that is not even well-formed does not. */
function verifies(digest: string | null, data: Buffer, key: KeyObject, signature: Buffer): boolean {
  try {
    return verify(digest, data, key, signature)
  } catch {
    return false
  }
}

/** The client data checks both ceremonies share: its type, the challenge, the origin, no cross-origin frame. */
function checkClientData(json: Buffer, type: string, expected: CeremonyExpectations): void {
  const clientData = readClientData(json)
  if (!isObject(clientData)) throw new PasskeyError('the client data is not a JSON object')
  if (clientData.type !== type) throw new PasskeyError(`the client data's type is not ${type}`)
  if (typeof clientData.challenge !== 'string' || !safeEqual(clientData.challenge, expected.challenge))
    throw new PasskeyError('the challenge is not the one this server made')
  if (clientData.origin !== expected.origin) throw new PasskeyError(`the page was not on ${expected.origin}`)
  if ((clientData.crossOrigin !== undefined && clientData.crossOrigin !== false) || clientData.topOrigin !== undefined)
    throw new PasskeyError('the ceremony ran in a frame of another origin')
}

/**
 * The client data as JSON: UTF-8, with a leading byte order mark passed over, as the UTF-8
 * decode of §7.1 and §7.2 does (unlike a form's values, where the URL standard keeps one).
 */
function readClientData(json: Buffer): unknown {
  try {
    return JSON.parse(utf8DroppingBom.decode(json))
  } catch {
    throw new PasskeyError('the client data is not JSON')
  }
}

/**
 * The authenticator data checks both ceremonies share: the RP ID, a person present and verified,
 * the backup flags, and a signature counter short of its end. A counter that is kept must grow at
 * each sign-in: a passkey stored with its counter at the end could never sign in again, yet would
 * count as the last one left when password sign-in is off.
 */
function checkAuthenticatorData(data: AuthenticatorData, rpId: string): void {
  if (!data.rpIdHash.equals(hash('sha256', rpId, 'buffer')))
    throw new PasskeyError(`the passkey was made for another site than ${rpId}`)
  if (!data.flags.userPresent) throw new PasskeyError('the device did not see a person present')
  if (!data.flags.userVerified) throw new PasskeyError('the device did not verify the person (PIN or biometrics)')
  if (data.flags.backedUp && !data.flags.backupEligible)
    throw new PasskeyError('the device says a passkey that cannot be backed up was backed up')
  if (data.counter === MAX_SIGNATURE_COUNTER)
    throw new PasskeyError('the signature counter is at its end, so it cannot grow')
}

// Where passkeys work, and the challenges: each is made for one browser (its session when the
// owner is signed in, else its CSRF cookie), for one purpose, and on a consent page for one
// pending request; it is used once, right or wrong, by an answer that names a passkey stored
// here, within five minutes. Anyone may ask for a challenge, so making one stores nothing: a
// challenge is 16 random bytes, its expiry, and an HMAC of both and of what it is bound to, under
// a key this process drew at start. Only used challenges are remembered, until they expire; using
// one costs a sign-in attempt with a passkey stored here (counted per address, as a password is,
// though not in the total), or needs the owner's session.

/** What a challenge is made for: checked by its HMAC when an answer comes back. */
export type PasskeyChallenge = {
  purpose: 'register' | 'sign-in'
  /** The hash of the session or CSRF cookie of the browser it was made for. */
  browser: string
  /** On a consent page: the hash of the pending request's id. */
  request: string | undefined
}

const PASSKEY_CHALLENGE_SECONDS = 300
const MAX_USED_CHALLENGES = 10_000

/**
 * Why an issuer cannot have passkeys, or undefined when it can. WebAuthn refuses an IP address
 * as RP ID, and browsers offer it only in a secure context: https, or http on localhost.
 * @see https://www.w3.org/TR/webauthn-3/#sctn-api
 */
function passkeyHostProblem(issuer: string): string | undefined {
  const { protocol } = new URL(issuer)
  const hostname = new URL(issuer).hostname.replace(/\.$/, '') // `localhost.` is localhost too
  if (isIpAddress(hostname)) {
    // on this machine, the same server under localhost; elsewhere, a name of one's own
    const { port, pathname } = new URL(issuer)
    const local = LOOPBACK_HOSTS.has(unbracketed(hostname))
    const named = local
      ? `${protocol}//localhost${port === '' ? '' : `:${port}`}${pathname}`
      : 'https://auth.example.com'
    return (
      'Passkeys need this server to be reached by a host name, not an IP address: set ISSUER to one, ' +
      `such as ${named.replace(/\/$/, '')}`
    )
  }
  if (protocol === 'http:' && !isLocalhostName(hostname)) {
    return (
      'Passkeys need https, or http on localhost: browsers offer them nowhere else. ' +
      'Put Latch behind TLS and set ISSUER to its https URL'
    )
  }
  return undefined
}

/**
 * Whether a host name is localhost or a name under it (`localhost.` too): loopback, to browsers a
 * secure context (RFC 6761 §6.3 asks every resolver to take it so; not every one does).
 */
function isLocalhostName(hostname: string): boolean {
  return /(^|\.)localhost\.?$/i.test(hostname)
}

/** What a page or a refusal says where passkeys cannot work (without a password, none are offered at all). */
function noPasskeysHere(config: Config): string {
  return passkeyHostProblem(config.issuer) ?? 'Passkeys need PASSWORD_HASH to be set'
}

/** Whether the sign-in and consent pages offer a passkey: when passkeys work here and the owner has one for here. */
async function offersPasskeys(ctx: Context): Promise<boolean> {
  return passkeysForHere(await ctx.store.listPasskeys(), ctx.config).length > 0
}

/** The passkeys that can sign in on the issuer's host. */
function passkeysForHere(passkeys: [string, Passkey][], config: Config): [string, Passkey][] {
  const rp = relyingParty(config)
  if (rp === undefined) return []
  return passkeys.filter(([, passkey]) => madeFor(passkey, rp.id))
}

/** Whether a passkey works on a host: only on the one it was made for (one stored before Latch noted it, anywhere). */
function madeFor(passkey: Passkey, rpId: string): boolean {
  return passkey.rpId === undefined || passkey.rpId === rpId
}

/**
 * The relying party a passkey is made for: the issuer's host name (its RP ID) and origin. None
 * without a password, where no one signs in, nor where passkeys cannot work (`passkeyHostProblem`).
 * @see https://www.w3.org/TR/webauthn-3/#rp-id
 */
function relyingParty(config: Config): { id: string; origin: string } | undefined {
  const issuer = new URL(config.issuer)
  if (config.passwordHash === undefined || passkeyHostProblem(config.issuer) !== undefined) return undefined
  return { id: issuer.hostname, origin: issuer.origin }
}

/**
 * The owner's WebAuthn user handle: opaque, the same on every device, and no secret. It names the
 * issuer as well as the owner: a device keeps one passkey per host name (the RP ID) and handle,
 * and replaces it with the next one made for both, so two Latches under one host name (on two
 * ports, or two paths) with one `ME` would each make the device forget the other's.
 */
function userHandleOf(config: Config): string {
  return base64url(hash('sha256', `latch user ${config.me} at ${config.issuer}`, 'buffer').subarray(0, 16))
}

/**
 * The name a device shows for the owner's passkey, beside the host name: `ME`, after the port or
 * path of `ISSUER` when it has one, which the device does not show. So the passkeys of two Latches
 * under one host name (see `userHandleOf`) can be told apart where the device offers both, even
 * by one that shows only the first 64 bytes of a name, as WebAuthn lets it.
 */
function accountName(config: Config): string {
  const issuer = new URL(config.issuer)
  const where = `${issuer.port === '' ? '' : `:${issuer.port}`}${issuer.pathname === '/' ? '' : issuer.pathname}`
  return where === '' ? config.me : `${where} · ${config.me}`
}

/** What binds a challenge to a browser: its session when signed in, else its CSRF cookie. */
function browserOf(visitor: Visitor): string {
  return hashSecret(visitor.session ?? visitor.csrf)
}

/** A new challenge for what it is made for, in base64url: 16 random bytes, 4 of expiry, 16 of HMAC. */
function makeChallenge(ctx: Context, made: PasskeyChallenge): string {
  const body = Buffer.alloc(20)
  randomFillSync(body, 0, 16)
  // on the steady clock, as the key lasts one process: a clock set back must not revive an expired one
  body.writeUInt32BE(Math.ceil(ctx.steadyNow() / 1000) + PASSKEY_CHALLENGE_SECONDS, 16)
  return base64url(Buffer.concat([body, challengeMac(ctx, body, made)]))
}

function challengeMac(ctx: Context, body: Buffer, made: PasskeyChallenge): Buffer {
  const binding = `latch passkey ${made.purpose} ${made.browser} ${made.request ?? '-'} `
  return createHmac('sha256', ctx.passkeys.key).update(binding).update(body).digest().subarray(0, 16)
}

/**
 * Takes the challenge the client data names, if Latch made it for this purpose, browser and
 * request and it has not expired: the expected challenge of the ceremony's checks. It is gone
 * afterwards, whatever the outcome, so an answer can never be replayed.
 */
function takeChallenge(
  ctx: Context,
  clientDataJSON: Buffer,
  wanted: { purpose: PasskeyChallenge['purpose']; browser: string; request?: string },
): string {
  const clientData = readClientData(clientDataJSON)
  const challenge = isObject(clientData) ? clientData.challenge : undefined
  if (typeof challenge !== 'string' || !/^[A-Za-z0-9_-]{48}$/.test(challenge))
    throw new PasskeyError('the client data names no challenge of this server')
  const bytes = Buffer.from(challenge, 'base64url')
  const body = bytes.subarray(0, 20)
  const made = { purpose: wanted.purpose, browser: wanted.browser, request: wanted.request }
  if (!timingSafeEqual(bytes.subarray(20), challengeMac(ctx, body, made)))
    throw new PasskeyError('the challenge was not made by this server for this page and browser: try again')
  const expiresAt = body.readUInt32BE(16) * 1000
  const { used } = ctx.passkeys
  const now = ctx.steadyNow()
  for (const [key, until] of used) {
    if (until > now) break // used in about the order they expire; one left behind goes later
    used.delete(key)
  }
  if (expiresAt <= now || used.has(challenge))
    throw new PasskeyError('the challenge was used before or has expired: try again')
  if (used.size >= MAX_USED_CHALLENGES)
    throw new PasskeyError('too many passkey answers came in the last five minutes: try again later')
  used.set(challenge, expiresAt)
  return challenge
}

/** The byte strings a passkey form carries, each in base64url; a missing or malformed one is refused. */
function readPasskeyFields<Name extends string>(form: Params, names: Name[]): Record<Name, Buffer> {
  const fields = {} as Record<Name, Buffer>
  for (const name of names) {
    const value = getParam(form, name)
    if (value === undefined || !/^[A-Za-z0-9_-]+$/.test(value))
      throw new PasskeyError(`the form's ${name} is missing or not base64url`)
    fields[name] = Buffer.from(value, 'base64url')
  }
  return fields
}

/**
 * Why a passkey answer is refused before it is counted (see `checkSignIn`): passkeys do not work
 * here, or it names none stored for here. A stranger, who knows no passkey's id, would else spend
 * the tries of an address, and the challenges that may be used at once, with answers of nothing.
 * Nor is it logged as a security event, which a stranger could send without end: the request's
 * own line says 401. Undefined when it names one.
 */
async function refuseUnknownPasskey(form: Params, ctx: Context): Promise<string | undefined> {
  const rp = relyingParty(ctx.config)
  try {
    if (rp === undefined) throw new PasskeyError(noPasskeysHere(ctx.config))
    await findPasskeyForHere(requireParam(form, 'credential'), rp, ctx)
    return undefined
  } catch (err) {
    if (!(err instanceof PasskeyError)) throw err
    return passkeyRefused(err)
  }
}

/**
 * A passkey sign-in from a form (see `checkSignIn`), of a passkey stored here: the challenge, the
 * passkey by its id, the user handle, the authentication ceremony's checks; then the new counter
 * and the time of use are stored. Returns why it is refused, after logging it, or undefined.
 */
async function checkPasskeySignIn(
  form: Params,
  on: { visitor: Visitor; request?: string },
  address: string,
  ctx: Context,
): Promise<string | undefined> {
  try {
    const rp = relyingParty(ctx.config)
    if (rp === undefined) throw new PasskeyError(noPasskeysHere(ctx.config))
    const id = requireParam(form, 'credential') // sent: `checkSignIn` came here for it
    const sent = readPasskeyFields(form, ['client_data', 'authenticator_data', 'signature'])
    const browser = browserOf(on.visitor)
    const challenge = takeChallenge(ctx, sent.client_data, { purpose: 'sign-in', browser, request: on.request })
    const response = {
      clientDataJSON: sent.client_data,
      authenticatorData: sent.authenticator_data,
      signature: sent.signature,
    }
    await changePasskeys(ctx, async () => {
      const passkey = await findPasskeyForHere(id, rp, ctx) // as the last change left it: removed, perhaps
      // §7.2 step 6: the owner was not named before the ceremony, so the device must say whose
      // passkey it is, with the handle it was made with. For one stored before Latch kept that
      // handle, the signature alone shows it is the passkey stored: the handle is not signed, so
      // it is kept only when it is the one Latch makes now, and a forged one cannot lock it out.
      const userHandle = getParam(form, 'user_handle') ?? ''
      if (
        passkey.userHandle === undefined ? !/^[A-Za-z0-9_-]{1,86}$/.test(userHandle) : userHandle !== passkey.userHandle
      )
        throw new PasskeyError('the passkey is not the owner of this server')
      const keptHandle = passkey.userHandle ?? (userHandle === userHandleOf(ctx.config) ? userHandle : undefined)
      const { publicKey, algorithm, counter } = passkey
      const expected = { challenge, origin: rp.origin, rpId: rp.id, publicKey, algorithm, counter }
      const now = ctx.now()
      const verified = verifyAuthentication(response, expected)
      const used = { counter: verified.counter, lastUsedAt: now, userHandle: keptHandle, rpId: rp.id }
      await ctx.store.savePasskey(id, { ...passkey, ...used }, now)
    })
    return undefined
  } catch (err) {
    if (!(err instanceof PasskeyError)) throw err
    logEvent(ctx, 'security', `a passkey sign-in was refused: ${err.message}`, address)
    return passkeyRefused(err)
  }
}

/** What the form says of a passkey sign-in refused. */
function passkeyRefused(err: PasskeyError): string {
  return `The passkey was refused: ${err.message}`
}

/** The stored passkey of this id, when it signs in on the issuer's host; else a PasskeyError says why. */
async function findPasskeyForHere(id: string, rp: { id: string }, ctx: Context): Promise<Passkey> {
  const passkey = await ctx.store.findPasskey(id)
  if (passkey === undefined)
    throw new PasskeyError(
      'it is not a passkey of this server (where the device offers several, choose another), or it was removed',
    )
  if (!madeFor(passkey, rp.id)) throw new PasskeyError(`it was made for ${passkey.rpId}, not for ${rp.id}`)
  return passkey
}

// --- The owner's pages ----------------------------------------------------------
// Sign-in and sign-out, `/apps` with its Revoke buttons, tokens for scripts, and the passkey
// forms. Signing in once starts a session, so later consents take one click (the explicit
// approve stays). Every button is a POST that carries the CSRF value (`requireFormToken`, and
// `requireOwner` where only the signed-in owner may act).

/**
 * Shows the connected apps to the signed-in owner, and a sign-in form to anyone else. No
 * standard defines this page: RFC 7009 lets an app revoke its own tokens, and here the owner
 * revokes an app's.
 */
async function handleAppsPage(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const visitor = await readVisitor(req, ctx)
  const headers = { 'Set-Cookie': csrfCookie(visitor, ctx.config) }
  if (!visitor.signedIn) {
    const notice = visitor.oldPassword
      ? 'The password was changed since you signed in here: sign in with the new one.'
      : undefined
    return sendSignInPage(res, 200, { visitor, headers, notice }, ctx)
  }
  await sendAppsPage(res, ctx, visitor, { headers })
}

/**
 * The apps page, with the logos client discovery still holds (the journal keeps no images), and
 * the owner's passkeys.
 */
async function sendAppsPage(
  res: ServerResponse,
  ctx: Context,
  visitor: Visitor,
  options: { notice?: string; status?: number; headers?: Record<string, string>; signInMessage?: string } = {},
): Promise<void> {
  const grants = await ctx.store.listGrants(ctx.now())
  const passkeys = await ctx.store.listPasskeys()
  const logoOf = (clientId: string): string | undefined => ctx.clients.get(clientId)?.info.logo
  const scripted = relyingParty(ctx.config) !== undefined
  const signInAgain = scripted && !signedInWithin(RECENT_SIGN_IN_SECONDS, visitor, ctx)
  const { signInMessage } = options
  // a failed sign-in is said beside the form it came from, or at the top when the page has none
  const notice = signInMessage !== undefined && !signInAgain ? escapeHtml(signInMessage) : options.notice
  const page = {
    csrf: formToken(visitor),
    config: ctx.config,
    notice,
    logoOf,
    passkeys,
    signInAgain,
    signInMessage,
    startedAt: ctx.startedAt,
  }
  const headers = { ...passkeyPageHeaders(ctx.config, scripted), ...options.headers }
  sendPage(res, options.status ?? 200, renderAppsPage(grants, page), headers)
}

/** The sign-in page, with a passkey button once the owner has a passkey. */
async function sendSignInPage(
  res: ServerResponse,
  status: number,
  page: { visitor: Visitor; message?: string; notice?: string; headers?: PageHeaders },
  ctx: Context,
): Promise<void> {
  const passkeys = await offersPasskeys(ctx)
  const { message, notice } = page
  const html = renderSignInPage({ csrf: formToken(page.visitor), config: ctx.config, message, notice, passkeys })
  sendPage(res, status, html, { ...passkeyPageHeaders(ctx.config, passkeys), ...page.headers })
}

/**
 * Checks the owner's password or passkey and starts a session. Signed in already, the owner
 * signs in again for what needs a recent sign-in: the new session replaces the old one.
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-10.12 RFC 6749 §10.12 (cross-site request forgery)
 */
async function handleSignIn(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const visitor = await requireFormToken(form, req, ctx, { signsIn: signsIn(form) })
  const again = visitor.session !== undefined && signsIn(form)
  if (visitor.signedIn && !again) return redirect(res, 303, endpointUrl(ctx.config, '/apps'))
  const refused = await checkSignIn(form, { visitor }, req, res, ctx)
  if (refused !== undefined && again) {
    const { status, message, headers } = refused
    return sendAppsPage(res, ctx, visitor, { status, headers, signInMessage: message }) // still signed in
  }
  if (refused !== undefined)
    return sendSignInPage(res, refused.status, { visitor, message: refused.message, headers: refused.headers }, ctx)
  const cookie = await startSession(ctx)
  await endSessionsNamed(req, ctx)
  redirect(res, 303, endpointUrl(ctx.config, '/apps'), { 'Set-Cookie': cookie })
}

/**
 * Ends the owner's session, here and in the store.
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-10.12 RFC 6749 §10.12 (cross-site request forgery)
 */
async function handleSignOut(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const { session } = await requireFormToken(await readForm(req), req, ctx)
  if (session !== undefined) await ctx.store.deleteSession(hashSecret(session))
  redirect(res, 303, endpointUrl(ctx.config, '/apps'), {
    'Set-Cookie': endedSessionCookie(ctx.config),
  })
}

/**
 * Ends every session of the owner, in every browser: after a lost phone or a shared computer.
 * @see https://www.rfc-editor.org/rfc/rfc6749#section-10.12 RFC 6749 §10.12 (cross-site request forgery)
 */
async function handleSignOutEverywhere(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  await requireOwner(await readForm(req), req, ctx)
  await ctx.store.deleteAllSessions()
  ctx.answered.clear() // no consent answered before may be answered again
  logEvent(ctx, 'security', 'the owner signed out everywhere, so every session ended', req)
  // the sign-in page at once, saying what happened: after a lost phone, the owner wants to know
  const visitor = await readVisitor(req, ctx)
  const headers = {
    'Set-Cookie': [endedSessionCookie(ctx.config), csrfCookie(visitor, ctx.config)],
  }
  const notice = 'You are signed out here and in every other browser: every session has ended.'
  await sendSignInPage(res, 200, { visitor, headers, notice }, ctx)
}

/**
 * Revokes one grant: its access and refresh tokens stop working at once, as RFC 7009 §2.1 asks
 * when an app revokes its refresh token.
 * @see https://www.rfc-editor.org/rfc/rfc7009#section-2.1 RFC 7009 §2.1
 */
async function handleAppRevocation(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const visitor = await requireOwner(form, req, ctx)
  const id = requireParam(form, 'grant')
  const grant = await ctx.store.findGrant(id, ctx.now())
  if (grant !== undefined) await ctx.store.revokeGrant(id, ctx.now())
  const notice =
    grant === undefined
      ? 'That app has no access any more: revoked already, or its access ended.'
      : `Revoked ${appName(grant)}: its tokens stopped working.`
  await sendAppsPage(res, ctx, visitor, { notice })
}

/**
 * Revokes every grant, once the owner has said yes a second time: the first press shows what
 * would end, with one button that carries `confirm=yes`.
 */
async function handleAllAppsRevocation(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const visitor = await requireOwner(form, req, ctx)
  const now = ctx.now()
  if (getParam(form, 'confirm') !== 'yes') {
    const grants = await ctx.store.listGrants(now)
    // a clock set back since an app was approved must not leave it out: the steady clock, which
    // stood still, and the latest approval listed, for one set back before a restart
    const asked = grants.reduce((latest, [, grant]) => Math.max(latest, grant.approvedAt), ctx.steadyNow())
    const page = { csrf: formToken(visitor), config: ctx.config, asked }
    return sendPage(res, 200, renderRevokeAllPage(grants, page))
  }
  // Every app approved by the time the owner was asked, to the second the store keeps: those
  // listed, and those approved before whose codes are redeemed meanwhile or later, which the
  // owner approved too. Not one approved later, when the answer is sent again (a reload) or late.
  const sent = getParam(form, 'asked') ?? ''
  const asked = /^\d{1,16}$/.test(sent) ? Number(sent) : now
  const revoked = await ctx.store.revokeApprovedBy(asked, now)
  ctx.answered.clear() // nor answered again, as a second press would: no approval from before gives access
  const notice =
    revoked === 0
      ? 'Nothing was left to revoke: every app approved by then has lost its access already.'
      : `Revoked ${countOf(revoked, 'app')}: ${revoked === 1 ? 'it has lost its' : 'they have lost their'} access.`
  await sendAppsPage(res, ctx, visitor, { notice })
}

/**
 * Makes a token for a script, a webhook or CI, which needs no sign-in flow: a grant of its own,
 * under the client_id of `/apps`, with one access token that lasts the chosen time and is shown
 * once. It is listed, revoked and introspected like any app's.
 */
async function handleScriptToken(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  await requireOwner(form, req, ctx)
  const given = getParam(form, 'name') ?? ''
  const name = given.length > MAX_NAME_LENGTH ? undefined : cleanName(given)
  if (name === undefined)
    throw new OAuthError('invalid_request', `Give the token a name of at most ${MAX_NAME_LENGTH} characters`)
  const scope = parseScope(getParam(form, 'scope'))
  if (scope.length === 0 || scope.length > MAX_SCOPES || scope.some((one) => one.length > MAX_SCOPE_LENGTH))
    throw new OAuthError('invalid_scope', `Give the token from 1 to ${MAX_SCOPES} scopes, separated by spaces`)
  const resource = readResources(form)
  const lifetime = readLifetime(getParam(form, 'lifetime'), ctx.config)
  const now = ctx.now()
  // The form's own random value names the grant, so the same form sent twice (a reload, or Back
  // and again) makes one token, not a second one that no one saw. A grant revoked since is
  // remembered, and not saved again.
  const once = getParam(form, 'once')
  const grantId = hashSecret(
    once !== undefined && SECRET_FORMAT.test(once) ? `a token for scripts ${once}` : createSecret(),
  )
  // sent twice at once (a double click), both would find no grant: the second waits for the
  // first to end, made or failed, and then finds what it left
  const previous = ctx.scriptGrantsUnderWay.get(grantId)
  let ended = () => {}
  const mine = new Promise<void>((resolve) => (ended = resolve))
  const turn = previous === undefined ? mine : previous.then(() => mine)
  ctx.scriptGrantsUnderWay.set(grantId, turn)
  await previous
  try {
    const stored = await ctx.store.findGrant(grantId, now)
    // its first try stored a grant without its token, revoked (or expired) since: nothing to make it for
    if (stored === undefined && ctx.scriptGrantsWithoutToken.delete(grantId)) {
      throw new OAuthError(
        'invalid_request',
        'The token of this form could not be made when it was first sent, and what that left was revoked since: ' +
          'make a new token',
      )
    }
    if (stored !== undefined) {
      if (!ctx.scriptGrantsWithoutToken.has(grantId)) {
        // a double click: the browser shows the second answer, and only the first showed the token
        const made = ctx.scriptTokensMadeLately.get(grantId)
        const showAgain =
          made !== undefined &&
          made.until > ctx.steadyNow() &&
          (await ctx.store.findToken(hashSecret(made.token), now)) !== undefined // not revoked meanwhile
        if (showAgain) return sendPage(res, 200, renderScriptTokenPage(name, made.token, ctx.config))
        return sendTokenMadeBefore(res, name, ctx.config)
      }
      // stored before without its token (a full disk): the form sent again makes it, if it asks for the same
      const ttl = lifetime === UNTIL_REVOKED ? MAX_DURATION_SECONDS : lifetime
      const same = stored.client_name === name && stored.accessTokenTtlSeconds === ttl
      if (!same || !sameWords(stored.scope, scope) || !sameWords(stored.resource, resource)) {
        throw new OAuthError(
          'invalid_request',
          'This form was sent before with other values, and its token could not be made then: ' +
            'revoke what it left on your apps page, then make a new token',
        )
      }
    }
    const token = await makeScriptToken(grantId, stored ?? { name, scope, resource, lifetime }, ctx)
    if (token === undefined) return sendTokenMadeBefore(res, name, ctx.config) // revoked since it was made
    logEvent(ctx, 'security', `the owner made a token for scripts named ${JSON.stringify(name)}`, req)
    rememberScriptToken(grantId, token, ctx)
    sendPage(res, 200, renderScriptTokenPage(name, token, ctx.config))
  } finally {
    ended()
    if (ctx.scriptGrantsUnderWay.get(grantId) === turn) ctx.scriptGrantsUnderWay.delete(grantId)
  }
}

/**
 * Keeps a token for scripts just made, in memory, for the seconds in which its form's button may be
 * pressed again: a double click, whose first answer the browser never shows. After that, the form
 * sent again (a reload) says the token was made, and shows it no more.
 */
function rememberScriptToken(grantId: string, token: string, ctx: Context): void {
  const made = ctx.scriptTokensMadeLately
  const remembered = { token, until: ctx.steadyNow() + SCRIPT_TOKEN_SHOWN_AGAIN_SECONDS * 1000 }
  made.set(grantId, remembered)
  // and then forgotten: the only copy of a secret is the owner's (only the owner makes them, one by one)
  setTimeout(
    () => made.get(grantId) === remembered && made.delete(grantId),
    SCRIPT_TOKEN_SHOWN_AGAIN_SECONDS * 1000,
  ).unref()
}

const SCRIPT_TOKEN_SHOWN_AGAIN_SECONDS = 10

/**
 * Saves the grant of a token for scripts, then its token, and returns the token; none if the grant
 * was revoked. Given a grant stored before without its token, makes the token for it.
 */
async function makeScriptToken(
  grantId: string,
  chosen: Grant | { name: string; scope: string[]; resource: string[]; lifetime: number },
  ctx: Context,
): Promise<string | undefined> {
  const now = ctx.now()
  let grant: Grant
  if ('client_id' in chosen) grant = chosen
  else {
    const { name, scope, resource, lifetime } = chosen
    const expiresAt = now + (lifetime === UNTIL_REVOKED ? MAX_DURATION_SECONDS : lifetime) * 1000
    grant = {
      client_id: scriptClientId(ctx.config),
      client_name: name,
      me: ctx.config.me,
      scope,
      resource,
      accessTokenTtlSeconds: (expiresAt - now) / 1000,
      approvedAt: now,
      lastUsedAt: 0,
      endsAt: lifetime === UNTIL_REVOKED ? undefined : expiresAt,
      expiresAt,
    }
    // The grant first: a snapshot of the journal keeps a token only with its grant. A write that
    // fails between the two (a full disk) leaves a grant without a token, which the same form,
    // sent again, gives its token; after a restart (or a kill), it is on /apps, to revoke.
    await ctx.store.saveGrant(grantId, grant, now)
    if ((await ctx.store.findGrant(grantId, now)) === undefined) return undefined
  }
  const { scope, resource, expiresAt } = grant
  const token = createSecret()
  const access = { kind: 'access', grantId, scope, resource, issuedAt: now, expiresAt, usedAt: undefined } as const
  rememberGrantWithoutToken(grantId, ctx)
  await ctx.store.saveToken(hashSecret(token), access, now)
  ctx.scriptGrantsWithoutToken.delete(grantId)
  return token
}

/** Whether two lists of scopes or resources hold the same words, in whatever order. */
function sameWords(a: string[], b: string[]): boolean {
  return a.length === b.length && a.every((word) => b.includes(word))
}

/** Remembers a grant for scripts until its token is stored: at most a hundred, the oldest forgotten first. */
function rememberGrantWithoutToken(grantId: string, ctx: Context): void {
  const waiting = ctx.scriptGrantsWithoutToken
  if (waiting.size >= 100) waiting.delete(waiting.values().next().value ?? '')
  waiting.add(grantId)
}

/** The answer to a token form sent again: its token was made, and shown, the first time. */
function sendTokenMadeBefore(res: ServerResponse, name: string, config: Config): void {
  const apps = `<a href="${escapeHtml(endpointUrl(config, '/apps'))}">your apps page</a>`
  const body = `<h1>This token was made already</h1>
<p>This form made the token <strong>${isolate(name)}</strong> when it was first sent, and a token is
shown only once. If you did not copy it, revoke it on ${apps} and make another.</p>`
  sendPage(res, 409, renderPage('This token was made already', body))
}

/** The longest name the owner may give a token for scripts or a passkey. */
const MAX_NAME_LENGTH = 100

/** The client_id of tokens made on /apps: the page they were made on. */
function scriptClientId(config: Config): string {
  return endpointUrl(config, '/apps')
}

/** The new token, shown once: the page is not stored by the browser (`no-store`, as every page). */
function renderScriptTokenPage(name: string, token: string, config: Config): string {
  return renderPage(
    'Your new token',
    `<h1>Your new token</h1>
<p>The token <strong>${isolate(name)}</strong> is ready. Copy it now: it is shown only this once.</p>
<pre class="token">${escapeHtml(token)}</pre>
<p>A script sends it as <code>Authorization: Bearer …</code>. Revoke it on your apps page when it is no
longer needed.</p>
<p><a href="${escapeHtml(endpointUrl(config, '/apps'))}">Back to your apps</a></p>`,
  )
}

// Passkeys: the owner adds them on /apps and signs in with them on the sign-in and consent pages.
// `/passkey.js`, the one script Latch serves, asks `/passkeys/challenge` for a challenge, lets the
// browser make or use a passkey, and posts the answer with the page's own form: to
// `/passkeys/add`, or as the sign-in of `/sign-in` and `/auth/consent` (see `checkSignIn`).

/**
 * Makes a challenge for a passkey button, bound to this browser and, on a consent page, to its
 * pending request, and answers with the options `navigator.credentials` takes, binary values in
 * base64url.
 * @see https://www.w3.org/TR/webauthn-3/#dictionary-makecredentialoptions WebAuthn §5.4
 * @see https://www.w3.org/TR/webauthn-3/#dictionary-assertion-options WebAuthn §5.5
 */
async function handlePasskeyChallenge(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const purpose = getParam(form, 'purpose')
  if (purpose !== 'register' && purpose !== 'sign-in')
    throw new OAuthError('invalid_request', 'purpose must be register or sign-in')
  // only the owner adds a passkey; anyone may try to sign in
  const visitor =
    purpose === 'register'
      ? await requireOwner(form, req, ctx)
      : await requireFormToken(form, req, ctx, { signsIn: true })
  const rp = relyingParty(ctx.config)
  if (rp === undefined) throw new OAuthError('invalid_request', noPasskeysHere(ctx.config))
  if (purpose === 'register' && !signedInWithin(RECENT_SIGN_IN_SECONDS, visitor, ctx))
    throw new OAuthError('access_denied', `${SIGN_IN_AGAIN} Reload this page to do so.`)
  const id = getParam(form, 'request')
  const request = id === undefined ? undefined : await ctx.store.findPending(hashSecret(id), ctx.now())
  if (id !== undefined && (request === undefined || !safeEqual(request.csrfHash, hashSecret(visitor.csrf))))
    throw new OAuthError('invalid_request', 'This sign-in request is unknown or has expired: start again from the app')
  const challenge = makeChallenge(ctx, {
    purpose,
    browser: browserOf(visitor),
    request: id === undefined ? undefined : hashSecret(id),
  })
  const timeout = PASSKEY_CHALLENGE_SECONDS * 1000
  if (purpose === 'sign-in') {
    // no allowCredentials: the device offers the passkeys it holds for this site, and no stranger learns their ids
    return sendJson(res, 200, { challenge, rpId: rp.id, timeout, userVerification: 'required', allowCredentials: [] })
  }
  const passkeys = await ctx.store.listPasskeys()
  sendJson(res, 200, {
    challenge,
    rp: { id: rp.id, name: `Latch for ${new URL(ctx.config.me).host}` },
    user: {
      id: userHandleOf(ctx.config),
      name: accountName(ctx.config),
      displayName: ctx.config.profile.name ?? ctx.config.me,
    },
    pubKeyCredParams: SUPPORTED_ALGORITHMS.map((alg) => ({ type: 'public-key', alg })),
    timeout,
    attestation: 'none',
    authenticatorSelection: { residentKey: 'required', requireResidentKey: true, userVerification: 'required' },
    excludeCredentials: passkeys.map(([credential]) => ({ type: 'public-key', id: credential })),
  })
}

/**
 * Adds the passkey the browser made: the registration ceremony's checks (`verifyRegistration`),
 * then the name the owner gave it.
 * @see https://www.w3.org/TR/webauthn-3/#sctn-registering-a-new-credential WebAuthn §7.1
 */
async function handlePasskeyAddition(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const visitor = await requireOwner(form, req, ctx)
  // its challenge was made within the 15 minutes, and lasts 5 more: a ceremony begun in time ends in time
  const late = !signedInWithin(RECENT_SIGN_IN_SECONDS + PASSKEY_CHALLENGE_SECONDS, visitor, ctx)
  if (late && relyingParty(ctx.config) !== undefined) return askToSignInAgain(req, res, visitor, ctx)
  const given = getParam(form, 'name') ?? ''
  const name = (given.length > MAX_NAME_LENGTH ? undefined : cleanName(given)) ?? 'Passkey'
  if (getParam(form, 'client_data') === undefined) {
    // the form sent without the script, whose button makes the passkey: nothing a stranger did
    const notice = 'No passkey was added: press Add a passkey, in a browser that makes passkeys.'
    return sendAppsPage(res, ctx, visitor, { notice, status: 400 })
  }
  // the page that said it was added, reloaded: its challenge is used, and its passkey is there
  const credential = getParam(form, 'credential')
  if (credential !== undefined && (await ctx.store.findPasskey(credential)) !== undefined)
    return sendAppsPage(res, ctx, visitor, { notice: 'That passkey was added before.' })
  const now = ctx.now()
  try {
    const rp = relyingParty(ctx.config)
    if (rp === undefined) throw new PasskeyError(noPasskeysHere(ctx.config))
    const sent = readPasskeyFields(form, ['client_data', 'attestation'])
    const challenge = takeChallenge(ctx, sent.client_data, { purpose: 'register', browser: browserOf(visitor) })
    const response = { clientDataJSON: sent.client_data, attestationObject: sent.attestation }
    const made = verifyRegistration(response, { challenge, origin: rp.origin, rpId: rp.id })
    await changePasskeys(ctx, async () => {
      if ((await ctx.store.findPasskey(made.id)) !== undefined) throw new PasskeyError('this passkey was added before')
      if ((await ctx.store.listPasskeys()).length >= MAX_PASSKEYS)
        throw new PasskeyError(`there are ${MAX_PASSKEYS} passkeys already: remove one first`)
      const { publicKey, algorithm, counter } = made
      const passkey = { name, publicKey, algorithm, counter, userHandle: userHandleOf(ctx.config), rpId: rp.id }
      await ctx.store.savePasskey(made.id, { ...passkey, addedAt: now, lastUsedAt: undefined }, now)
    })
  } catch (err) {
    if (!(err instanceof PasskeyError)) throw err
    // the form sent twice at once: the first press takes the challenge and is saving the passkey
    await ctx.passkeys.changes
    if (credential !== undefined && (await ctx.store.findPasskey(credential)) !== undefined)
      return sendAppsPage(res, ctx, visitor, { notice: 'That passkey was added before.' })
    logEvent(ctx, 'security', `a passkey was not added: ${err.message}`, req)
    return sendAppsPage(res, ctx, visitor, {
      notice: `The passkey was not added: ${escapeHtml(err.message)}.`,
      status: 400,
    })
  }
  logEvent(ctx, 'security', `the owner added a passkey named ${JSON.stringify(name)}`, req)
  await sendAppsPage(res, ctx, visitor, { notice: `Added the passkey ${isolate(name)}.` })
}

/** Removes a passkey; not the last one while password sign-in is off, which would lock the owner out. */
async function handlePasskeyRemoval(req: IncomingMessage, res: ServerResponse, ctx: Context): Promise<void> {
  const form = await readForm(req)
  const visitor = await requireOwner(form, req, ctx)
  const id = requireParam(form, 'credential')
  const removed = await changePasskeys(ctx, async () => {
    const passkey = await ctx.store.findPasskey(id)
    if (passkey === undefined) return 'gone'
    // the last one that can sign in here: one made for another host does not count
    const usable = passkeysForHere(await ctx.store.listPasskeys(), ctx.config)
    if (!ctx.config.passwordSignIn && usable.length === 1 && usable[0][0] === id) return 'last'
    await ctx.store.deletePasskey(id)
    return passkey
  })
  if (removed === 'gone') return sendAppsPage(res, ctx, visitor, { notice: 'That passkey was removed before.' })
  if (removed === 'last') {
    const notice = 'This is your last passkey, and password sign-in is off: add another passkey before you remove it.'
    return sendAppsPage(res, ctx, visitor, { notice, status: 409 })
  }
  logEvent(ctx, 'security', `the owner removed the passkey named ${JSON.stringify(removed.name)}`, req)
  const notice =
    `Removed the passkey ${isolate(removed.name)}: it no longer signs in. If it was lost, ` +
    'sign out everywhere too, to end the sessions it started.'
  await sendAppsPage(res, ctx, visitor, { notice })
}

/**
 * Runs a change to the passkeys once those before it have ended: a check (is this the last one?
 * does the counter grow?) and the write it allows cannot interleave with another change's.
 */
function changePasskeys<T>(ctx: Context, change: () => Promise<T>): Promise<T> {
  const done = ctx.passkeys.changes.then(change)
  ctx.passkeys.changes = done.catch(() => undefined)
  return done
}

/** The one script, for the passkey buttons; the pages that have one allow exactly it. */
async function handlePasskeyScript(_req: IncomingMessage, res: ServerResponse): Promise<void> {
  closeIfBodyUnread(res)
  res.writeHead(200, {
    'Content-Type': 'text/javascript; charset=utf-8',
    'Content-Length': String(Buffer.byteLength(PASSKEY_SCRIPT)),
    'Cache-Control': 'no-cache',
    'X-Content-Type-Options': 'nosniff',
  })
  res.end(PASSKEY_SCRIPT)
}

const MAX_PASSKEYS = 20

/**
 * A passkey is a way to sign in, and it outlasts every session: "Sign out everywhere" and a new
 * password leave it working. So adding one asks for a sign-in of the last 15 minutes, lest a
 * browser left signed in, or a copied session cookie, keep the owner's place for good. The owner
 * signs in again on `/apps`, which starts a fresh session. What an app or a script gets is
 * listed on `/apps` and ended by "Revoke all", and a signed-in owner approves an app in one
 * click anyway: making a token for a script asks for no more.
 * @see https://passkeys.dev/docs/use-cases/reauth/ (reauthentication before a sensitive action)
 */
const RECENT_SIGN_IN_SECONDS = 15 * 60

const RECENT_MINUTES = RECENT_SIGN_IN_SECONDS / 60
const SIGN_IN_AGAIN = `To add a passkey, sign in again first: your sign-in is more than ${RECENT_MINUTES} minutes old.`

/** Whether the visitor signed in less than `seconds` ago; not when the clock says the sign-in is yet to come. */
function signedInWithin(seconds: number, visitor: Visitor, ctx: Context): boolean {
  if (ctx.config.passwordHash === undefined) return true
  const age = visitor.signedInAt === undefined ? Infinity : ctx.now() - visitor.signedInAt
  return age >= 0 && age < seconds * 1000
}

/** Answers a passkey sent with too old a sign-in: the apps page, which asks for another in its place. */
async function askToSignInAgain(
  req: IncomingMessage,
  res: ServerResponse,
  visitor: Visitor,
  ctx: Context,
): Promise<void> {
  const minutes = Math.floor((ctx.now() - (visitor.signedInAt ?? 0)) / 60_000)
  logEvent(ctx, 'security', `a passkey was not added: the session signed in ${minutes} minutes ago`, req)
  await sendAppsPage(res, ctx, visitor, { notice: escapeHtml(SIGN_IN_AGAIN), status: 403 })
}

function renderSignInPage(page: {
  csrf: string
  config: Config
  message?: string
  notice?: string
  passkeys: boolean
}): string {
  const { config } = page
  const notice = page.notice === undefined ? '' : `<p class="notice" role="status">${escapeHtml(page.notice)}</p>\n`
  return renderPage(
    'Sign in',
    `<h1>Sign in</h1>
${notice}<p>Sign in as <code>${escapeHtml(config.me)}</code> to see the apps you have connected.</p>
${renderSignInForm(config, page.csrf, { message: page.message, passkeys: page.passkeys, autofocus: true })}`,
    page.passkeys ? renderPasskeyScript(config) : '',
  )
}

/** The form that posts a sign-in: the password, a passkey, or both, as the owner may sign in here. */
function renderSignInForm(
  config: Config,
  csrf: string,
  form: { message?: string; passkeys: boolean; autofocus: boolean },
): string {
  const passkey = form.passkeys ? renderPasskeyButton(config, 'Sign in with a passkey', 'sign-in') : ''
  const fields = config.passwordSignIn
    ? `${renderPasswordField(config, form.message, form.autofocus)}
<div class="actions"><button class="primary">Sign in</button>${passkey}</div>`
    : renderPasskeysOnly(form.message, passkey)
  return `<form method="post" action="${escapeHtml(endpointUrl(config, '/sign-in'))}">
<input type="hidden" name="csrf" value="${escapeHtml(csrf)}">
${fields}
</form>`
}

/** What the apps page shows beside the grants: a logo per client_id, the passkeys, and what was just done. */
type AppsPage = {
  csrf: string
  config: Config
  notice?: string
  logoOf: (clientId: string) => string | undefined
  passkeys: [string, Passkey][]
  /** Passkeys work here, but the sign-in is too old to add one: a sign-in form in its place. */
  signInAgain: boolean
  /** Why the last sign-in from that form failed. */
  signInMessage?: string
  /** When Latch started: a last use before it may not be known (`Store.touchGrant`). */
  startedAt: number
}

/**
 * When a grant's tokens were last used. A token for scripts starts with none; and a use that the
 * store kept in memory only is forgotten at a restart: before one, a grant's last use is unknown.
 */
function lastUse(grant: Grant, startedAt: number): string {
  if (grant.lastUsedAt !== 0) return formatTime(grant.lastUsedAt)
  return grant.approvedAt >= startedAt ? 'Never' : 'Not since Latch last started'
}

/**
 * The most apps the apps page (and "Revoke all") lists, the ones approved last: a script that
 * approves thousands (a test suite) would make a page of megabytes, and its making stall every
 * request meanwhile.
 */
const MAX_APPS_LISTED = 200

/** The apps a page lists (`grants` come oldest first), and how many approved before them it leaves out. */
function appsListed(grants: [string, Grant][]): { listed: [string, Grant][]; unlisted: number } {
  const unlisted = Math.max(0, grants.length - MAX_APPS_LISTED)
  return { listed: grants.slice(unlisted), unlisted }
}

function renderAppsPage(grants: [string, Grant][], page: AppsPage): string {
  const { config } = page
  const csrfField = `<input type="hidden" name="csrf" value="${escapeHtml(page.csrf)}">`
  const { listed, unlisted } = appsListed(grants)
  const older =
    unlisted === 0
      ? ''
      : `<p class="muted">The ${MAX_APPS_LISTED} approved last are listed; ${unlisted} approved before them are ` +
        'not, and "Revoke all" revokes them too.</p>\n'
  const apps = listed
    .map(([id, grant]) => {
      const logo = page.logoOf(grant.client_id)
      const image =
        logo === undefined ? '' : `<img class="logo" src="${escapeHtml(logo)}" alt="" width="32" height="32"> `
      // the services a token is for (RFC 8707), and its scopes: a grant may have either or both
      const services =
        grant.resource.length === 0
          ? ''
          : `<dt>${grant.resource.length === 1 ? 'Service' : 'Services'}</dt>` +
            `<dd>${grant.resource.map((resource) => `<code>${isolate(resource)}</code>`).join(' ')}</dd>\n`
      const scopes = grant.scope.length === 0 ? '' : `<dt>Scopes</dt><dd>${escapeHtml(grant.scope.join(' '))}</dd>\n`
      // approved before ME changed: the app knows the owner by the old one, which may be someone else's now
      const me = grant.me === config.me ? '' : `<dt>Signs in as</dt><dd><code>${isolate(grant.me)}</code></dd>\n`
      return `<section class="app">
<h2>${image}${appName(grant)}</h2>
<dl>
${
  grant.client_id === scriptClientId(config)
    ? '<dt>App</dt><dd>A token for scripts, made here</dd>'
    : grant.client_name === undefined
      ? ''
      : `<dt>App</dt><dd><code>${isolate(grant.client_id)}</code></dd>`
}
${services}${scopes}${me}<dt>Approved</dt><dd>${formatTime(grant.approvedAt)}</dd>
<dt>Last used</dt><dd>${lastUse(grant, page.startedAt)}</dd>
<dt>Access ends</dt><dd>${grant.endsAt === undefined ? untilRevoked(grant, config) : formatTime(grant.endsAt)}</dd>
</dl>
${renderButton(config, '/apps/revoke', `${csrfField}${grantField(id)}`, 'danger', 'Revoke', plainName(grant))}
</section>`
    })
    .join('\n')
  const signOut = config.passwordHash === undefined ? '' : renderButton(config, '/sign-out', csrfField, '', 'Sign out')
  const revokeAll = renderButton(config, '/apps/revoke-all', csrfField, 'danger', 'Revoke all…')
  const actions = `<div class="actions">${revokeAll}</div>`
  const notice = page.notice === undefined ? '' : `<p class="notice" role="status">${page.notice}</p>\n`
  const everywhere =
    config.passwordHash === undefined
      ? ''
      : '<p class="muted">Signed in on a device you no longer have?</p>\n' +
        renderButton(config, '/sign-out-everywhere', csrfField, '', 'Sign out everywhere')
  return renderPage(
    'Connected apps',
    `<div class="bar"><span class="muted">${escapeHtml(config.me)}</span>${signOut}</div>
<h1>Connected apps</h1>
${notice}<p>These apps can act as you. Revoking one ends its access at once; otherwise it ends when
you chose on the consent page.</p>
${apps === '' ? '<p class="muted">No app holds a token right now.</p>' : older + apps}
${actions}
${renderScriptTokenForm(config, csrfField)}
${renderPasskeys(page, csrfField)}
${everywhere}`,
    relyingParty(config) === undefined ? '' : renderPasskeyScript(config),
  )
}

/**
 * The owner's passkeys, each with a Remove button, and the form that adds one; or, once the
 * sign-in is too old for that, a sign-in form, whose success comes back here with a fresh session.
 */
function renderPasskeys(page: AppsPage, csrfField: string): string {
  const { passkeys, config, csrf, signInAgain } = page
  if (config.passwordHash === undefined) return '' // nothing to sign in to
  const list = passkeys
    .map(([id, passkey]) => {
      const field = `${csrfField}<input type="hidden" name="credential" value="${escapeHtml(id)}">`
      const lastUsed = passkey.lastUsedAt === undefined ? 'Never' : formatTime(passkey.lastUsedAt)
      const elsewhere =
        passkey.rpId === undefined || passkey.rpId === relyingParty(config)?.id
          ? ''
          : `<dt>Made for</dt><dd><code>${isolate(passkey.rpId)}</code>: it cannot sign in here</dd>`
      return `<div class="passkey">
<h3>${isolate(passkey.name)}</h3>
<dl><dt>Added</dt><dd>${formatTime(passkey.addedAt)}</dd><dt>Last used</dt><dd>${lastUsed}</dd>${elsewhere}</dl>
${renderButton(config, '/passkeys/remove', field, 'danger', 'Remove', passkey.name)}
</div>`
    })
    .join('\n')
  const add =
    relyingParty(config) === undefined
      ? `<p class="muted">${escapeHtml(noPasskeysHere(config))}.</p>`
      : signInAgain
        ? `<p class="muted">${escapeHtml(SIGN_IN_AGAIN)}</p>
${renderSignInForm(config, csrf, {
  message: page.signInMessage,
  passkeys: passkeysForHere(passkeys, config).length > 0,
  autofocus: page.signInMessage !== undefined,
})}`
        : `<form method="post" action="${escapeHtml(endpointUrl(config, '/passkeys/add'))}">
${csrfField}
<p data-passkey-only hidden><label>Passkey name
<input name="name" required maxlength="${MAX_NAME_LENGTH}" placeholder="Phone"></label></p>
<p class="muted" data-passkey-missing>To add one, open this page in a browser that makes passkeys, with scripts on.</p>
<div class="actions">${renderPasskeyButton(config, 'Add a passkey', 'register')}</div>
</form>`
  return `<section class="passkeys">
<h2>Passkeys</h2>
<p class="muted">Sign in with your device's screen lock instead of the password.</p>
${list === '' ? '<p class="muted">No passkey yet.</p>' : list}
${add}
</section>`
}

/** A button the passkey script shows and runs; hidden in a browser without WebAuthn or scripts. */
function renderPasskeyButton(config: Config, label: string, purpose: 'register' | 'sign-in', approve = false): string {
  const challenge = escapeHtml(endpointUrl(config, '/passkeys/challenge'))
  const decision = approve ? ' name="decision" value="approve"' : ''
  const data = `data-passkey="${purpose}" data-challenge="${challenge}"`
  // a submit button, so that Enter where it comes first (the sign-in page with passwords off)
  // presses it; on a consent page a hidden one comes first, and Enter sends nothing
  return `<button ${data}${decision} hidden>${label}</button>`
}

/** In place of the password field once password sign-in is off. */
function renderPasskeysOnly(message: string | undefined, button: string): string {
  const error = message === undefined ? '' : `<p class="error" role="alert">${escapeHtml(message)}</p>\n`
  const actions = button === '' ? '' : `\n<div class="actions">${button}</div>`
  const missing = 'Sign in with a passkey: open this page in a browser that has one.'
  return `${error}<p class="muted" data-passkey-missing>${missing}</p>${actions}`
}

function renderPasskeyScript(config: Config): string {
  return `<script src="${escapeHtml(endpointUrl(config, '/passkey.js'))}" defer></script>`
}

/** The second question before "Revoke all": which apps would lose their access. */
function renderRevokeAllPage(grants: [string, Grant][], page: { csrf: string; config: Config; asked: number }): string {
  const { config } = page
  const back = `<p><a href="${escapeHtml(endpointUrl(config, '/apps'))}">Back to your apps</a></p>`
  const csrfField = `<input type="hidden" name="csrf" value="${escapeHtml(page.csrf)}">`
  const asked = `<input type="hidden" name="asked" value="${page.asked}">`
  const confirm = `${csrfField}<input type="hidden" name="confirm" value="yes">${asked}`
  const yes = renderButton(config, '/apps/revoke-all', confirm, 'danger', 'Yes, revoke all')
  const button = `<div class="actions">${yes}</div>`
  // an app approved a moment ago whose code is not redeemed yet holds no token, and is not listed
  const codeLife = formatPeriod(config.codeTtlSeconds)
  if (grants.length === 0) {
    return renderPage(
      'Revoke all apps?',
      `<h1>Revoke all apps?</h1>
<p>No app holds a token right now. This would still stop an app you approved in the last ${codeLife} that has
not collected its access yet.</p>
${button}
${back}`,
    )
  }
  const { listed, unlisted } = appsListed(grants)
  const names =
    listed.map(([, grant]) => `<li>${appName(grant)}</li>`).join('\n') +
    (unlisted === 0 ? '' : `\n<li>and ${unlisted} approved before them</li>`)
  return renderPage(
    'Revoke all apps?',
    `<h1>Revoke all apps?</h1>
<p>${grants.length === 1 ? 'This app loses its' : `These ${grants.length} apps lose their`} access at once,
tokens for scripts included. An app that still needs access will have to ask you again.</p>
<ul>
${names}
</ul>
<p>So does an app you approved in the last ${codeLife} that has not collected its access yet.</p>
${button}
${back}`,
  )
}

/** An app's name, or its client_id, as plain text. */
function plainName(grant: Grant): string {
  return grant.client_name ?? grant.client_id
}

/** An app as the owner's pages name it, escaped: its name, or its client_id. */
function appName(grant: Grant): string {
  return isolate(plainName(grant))
}

/**
 * What "until you revoke it" means on /apps: an app's refresh token also ends when it goes unused
 * for long. A token for a script has none: its one access token lasts until it is revoked, or
 * for the longest a token may, ten years.
 */
function untilRevoked(grant: Grant, config: Config): string {
  if (grant.client_id === scriptClientId(config))
    return `When you revoke it, or on ${formatTime(grant.approvedAt + grant.accessTokenTtlSeconds * 1000)}`
  return `When you revoke it, or after ${formatPeriod(config.refreshTokenTtlSeconds)} unused`
}

/** The form that makes a token for a script: a name, scopes, an optional service, a lifetime. */
function renderScriptTokenForm(config: Config, csrfField: string): string {
  return `<section class="maker">
<h2>A token for a script</h2>
<p class="muted">For a webhook, CI or a shell script that posts as you: no app, no sign-in.</p>
<form method="post" action="${escapeHtml(endpointUrl(config, '/apps/tokens'))}">
${csrfField}<input type="hidden" name="once" value="${createSecret()}">
<p><label>Token name <input name="name" required maxlength="${MAX_NAME_LENGTH}" placeholder="Deploy notes"></label></p>
<p><label>Scopes <input name="scope" required value="create" autocapitalize="none" spellcheck="false"></label></p>
<p><label>For the service at (optional)
<input name="resource" type="url" aria-describedby="resource-note"></label></p>
<p class="muted" id="resource-note">Its URL, as <code>https://example.com/mcp</code>. Only a service that
names itself when it checks a token, as an MCP server does, takes a token made for it. Leave it
empty for Micropub.</p>
${renderLifetimeChoice(config, UNTIL_REVOKED)}
<div class="actions"><button class="primary">Make a token</button></div>
</form>
</section>`
}

function grantField(id: string): string {
  return `<input type="hidden" name="grant" value="${escapeHtml(id)}">`
}

/**
 * A form that is one button: it posts the hidden fields to the path. `about` names what a button
 * of a list acts on, for a screen reader's list of buttons: "Revoke Jot Notes", not "Revoke" again.
 */
function renderButton(config: Config, path: string, fields: string, kind: string, label: string, about?: string) {
  const named = about === undefined ? '' : ` aria-label="${escapeHtml(`${label} ${about}`)}"`
  const button = `<button${kind === '' ? '' : ` class="${kind}"`}${named}>${label}</button>`
  return `<form method="post" action="${escapeHtml(endpointUrl(config, path))}">${fields}${button}</form>`
}

// --- Fetching client information ------------------------------------------------
// IndieAuth §4.2  https://indieauth.spec.indieweb.org/#client-information-discovery
// Latch fetches the client_id URL to learn the app's name, logo and redirect URIs. Fetching a
// URL a stranger chose is the classic way into a private network, so: http(s) only; never a
// loopback client ("the authorization endpoint MUST NOT fetch the client_id"); the name is
// resolved first, every address checked, and the connection made to the address checked; no
// redirects; a short deadline, the page's and its logo's together; a capped body; only a 200 counts.

/** How Latch fetches clients: tests and embedders may swap the resolver and the HTTP agent. */
export type ClientFetchOptions = {
  /**
   * Resolves a host name to all its addresses; defaults to `dns.lookup`, which honours /etc/hosts.
   * It must settle: at most 8 lookups are under way at once in the process, whichever Latch asked.
   */
  lookup?: (hostname: string) => Promise<LookupAddress[]>
  /** The agent requests go through; by default none: each fetch makes a connection of its own. */
  agent?: Agent
  /** How long a client's page and its logo may take, together, resolving included; defaults to 5 seconds. */
  timeoutMs?: number
}

const CLIENT_FETCH_TIMEOUT_MS = 5_000
const MAX_CLIENT_DOCUMENT_BYTES = 256 * 1024
/** The draft's "recommended maximum size to read is 5 kilobytes" (§8.7). */
const MAX_METADATA_DOCUMENT_BYTES = 5 * 1024
const MAX_LOGO_BYTES = 64 * 1024
const MAX_CLIENT_CACHE_SECONDS = 86_400
const HEURISTIC_CLIENT_CACHE_SECONDS = 60
const MAX_REDIRECT_URIS = 20
const LOGO_TYPES = new Set(['image/png', 'image/jpeg', 'image/gif', 'image/webp', 'image/avif'])

/**
 * What discovery knows of a client, or that it knows nothing. A client is fetched at most once
 * per Cache-Control lifetime; requests for the same client while it is being fetched share the
 * fetch; a failure is remembered for 30 seconds; and at most 8 fetches run at once, with 8 more
 * waiting, so that a flood of made-up clients costs a bounded amount of memory. One address
 * (the request's, as `CONNECTION_LIMITS` groups them; loopback is not counted) may have at most 2
 * of those under way, host-name lookups they left behind included, so that a stranger whose
 * pages or names never answer cannot hold every slot and keep other people's apps from being
 * looked up. Why a fetch failed goes to the log only: it can name addresses and ports of the
 * server's network.
 */
async function findClient(clientId: string, req: IncomingMessage, ctx: Context): Promise<ClientLookup> {
  const now = ctx.steadyNow()
  const cached = ctx.clients.get(clientId)
  if (cached !== undefined && cached.expiresAt > now) return { info: cached.info }
  if (isLoopbackUrl(clientId)) return {}
  const failed = ctx.failedClients.get(clientId)
  if (failed !== undefined && failed.until > now) return failed.busy ? { busy: true } : {}
  let lookup = ctx.clientLookups.get(clientId)
  if (lookup === undefined) {
    const requester = CONNECTION_LIMITS.groupOf(clientAddress(req, ctx.trustedProxies))
    const started = requester === undefined ? 0 : (ctx.lookupsBy.get(requester) ?? 0)
    if (started >= MAX_LOOKUPS_BY_ONE) {
      logEvent(
        ctx,
        'discovery',
        `${clientId} was not fetched: ${requester} has ${started} apps being looked up already`,
      )
      return { busy: true }
    }
    if (requester !== undefined) ctx.lookupsBy.set(requester, started + 1)
    const hostLookups: Promise<unknown>[] = []
    lookup = fetchClient(clientId, ctx, hostLookups).finally(() => ctx.clientLookups.delete(clientId))
    ctx.clientLookups.set(clientId, lookup)
    // The requester's count lasts as long as its host-name lookups, which may go on long after
    // the fetch gave up: else one address, trying again at each deadline, would hold all
    // MAX_LOOKUPS_UNDERWAY of them.
    if (requester !== undefined) {
      void lookup
        .then(() => Promise.allSettled(hostLookups))
        .then(() => {
          const left = (ctx.lookupsBy.get(requester) ?? 1) - 1
          if (left === 0) ctx.lookupsBy.delete(requester)
          else ctx.lookupsBy.set(requester, left)
        })
    }
  }
  return lookup
}

/** The lookups one address may have under way at once (see `findClient`). */
const MAX_LOOKUPS_BY_ONE = 2

async function fetchClient(clientId: string, ctx: Context, hostLookups: Promise<unknown>[]): Promise<ClientLookup> {
  try {
    const options = { allowPrivate: ctx.config.clientFetchPrivate, fetch: ctx.clientFetch, hostLookups }
    const { info, maxAgeSeconds } = await withSlot(
      ctx.clientFetchSlots,
      CLIENT_FETCH_SLOTS,
      () => new DiscoveryBusy('too many apps are being looked up at once'),
      () => discoverClient(clientId, options),
    )
    ctx.clients.delete(clientId)
    if (maxAgeSeconds > 0) {
      if (ctx.clients.size >= MAX_CACHED_CLIENTS) ctx.clients.delete(ctx.clients.keys().next().value ?? '')
      ctx.clients.set(clientId, { info, expiresAt: ctx.steadyNow() + maxAgeSeconds * 1000 })
    }
    return { info }
  } catch (err) {
    const failure = err instanceof Error ? err.message : String(err)
    // An invalid Client ID Metadata Document refuses the request, and is not remembered: its
    // author may fix it and try again at once (draft-ietf-oauth-client-id-metadata-document §5.2).
    if (err instanceof InvalidClientDocument) return { refused: failure }
    logEvent(ctx, 'discovery', `${clientId} could not be fetched: ${failure}`)
    if (!(err instanceof DiscoveryBusy)) {
      ctx.failedClients.delete(clientId)
      if (ctx.failedClients.size >= MAX_REMEMBERED_FAILURES)
        ctx.failedClients.delete(ctx.failedClients.keys().next().value ?? '')
      const until = ctx.steadyNow() + FAILED_CLIENT_MEMORY_SECONDS * 1000
      ctx.failedClients.set(clientId, { until, busy: err instanceof ClientSiteBusy })
    }
    return err instanceof DiscoveryBusy || err instanceof ClientSiteBusy ? { busy: true } : {}
  }
}

/**
 * Discovery refused for the server's own load, or out of time, which that load can cause (see
 * `withDeadline`): not the client's fault, so not remembered as a failure, and no same-host pass.
 */
class DiscoveryBusy extends Error {}

/**
 * The client's site answered 429 or 5xx: overloaded, or limiting Latch's fetches, which a
 * stranger can bring about by asking for the client again and again. Remembered as a failure,
 * so that Latch leaves the site alone for a while, but busy: no same-host pass either.
 */
class ClientSiteBusy extends Error {}

const MAX_CACHED_CLIENTS = 100
const MAX_REMEMBERED_FAILURES = 1_000
const FAILED_CLIENT_MEMORY_SECONDS = 30
const CLIENT_FETCH_SLOTS = { running: 8, waiting: 8 }

/**
 * Addresses Latch never connects to: every range of the IANA IPv4 and IPv6 special-purpose
 * address registries that is not globally reachable, and multicast.
 * @see https://www.iana.org/assignments/iana-ipv4-special-registry/
 * @see https://www.iana.org/assignments/iana-ipv6-special-registry/
 */
const FORBIDDEN_ADDRESSES = new BlockList()
for (const [network, prefix] of [
  ['0.0.0.0', 8], // "this network"
  ['127.0.0.0', 8], // loopback
  ['169.254.0.0', 16], // link-local, and cloud metadata services
  ['192.0.0.0', 24], // IETF protocol assignments
  ['192.0.2.0', 24], // documentation (TEST-NET-1)
  ['192.88.99.0', 24], // deprecated 6to4 relay anycast
  ['198.18.0.0', 15], // benchmarking
  ['198.51.100.0', 24], // documentation (TEST-NET-2)
  ['203.0.113.0', 24], // documentation (TEST-NET-3)
  ['224.0.0.0', 4], // multicast
  ['240.0.0.0', 4], // reserved, and the limited broadcast address 255.255.255.255
] as const) {
  FORBIDDEN_ADDRESSES.addSubnet(network, prefix, 'ipv4')
}
for (const [network, prefix] of [
  ['::', 96], // unspecified, loopback, and the deprecated IPv4-compatible addresses (::127.0.0.1)
  ['64:ff9b:1::', 48], // local-use IPv4/IPv6 translation
  ['100::', 64], // discard-only
  ['100:0:0:1::', 64], // dummy prefix
  ['2001::', 23], // IETF protocol assignments, Teredo among them
  ['2001:db8::', 32], // documentation
  ['2002::', 16], // 6to4
  ['3fff::', 20], // documentation
  ['5f00::', 16], // segment routing (SRv6) SIDs
  ['fe80::', 10], // link-local
  ['fec0::', 10], // site-local, deprecated
  ['ff00::', 8], // multicast
] as const) {
  FORBIDDEN_ADDRESSES.addSubnet(network, prefix, 'ipv6')
}

/** Private addresses: allowed only with `CLIENT_FETCH_PRIVATE=allow`, for clients on a LAN. */
const PRIVATE_ADDRESSES = new BlockList()
for (const [network, prefix] of [
  ['10.0.0.0', 8],
  ['100.64.0.0', 10],
  ['172.16.0.0', 12],
  ['192.168.0.0', 16],
] as const) {
  PRIVATE_ADDRESSES.addSubnet(network, prefix, 'ipv4')
}
PRIVATE_ADDRESSES.addSubnet('fc00::', 7, 'ipv6') // unique local

/** Why Latch may not connect to an address, or undefined when it may. IPv4 inside IPv6 is checked as IPv4. */
export function addressProblem(address: string, allowPrivate: boolean): string | undefined {
  const embedded = isIPv6(address) ? embeddedIpv4(address) : address
  const [checked, type] = embedded === undefined ? [address, 'ipv6' as const] : [embedded, 'ipv4' as const]
  if (FORBIDDEN_ADDRESSES.check(checked, type))
    return `it resolves to ${address}, a loopback, link-local or special-use address`
  if (!allowPrivate && PRIVATE_ADDRESSES.check(checked, type))
    return `it resolves to ${address}, a private address (CLIENT_FETCH_PRIVATE=allow permits it)`
  return undefined
}

/**
 * The IPv4 address an IPv6 address carries in its last 32 bits, for the forms that reach it:
 * IPv4-mapped (`::ffff:0:0/96`), IPv4-translated (`::ffff:0:0:0/96`) and NAT64 (`64:ff9b::/96`).
 */
function embeddedIpv4(address: string): string | undefined {
  const words = ipv6Words(address)
  const zeros = (from: number, to: number) => words.slice(from, to).every((word) => word === 0)
  const mapped = zeros(0, 5) && words[5] === 0xffff
  const translated = zeros(0, 4) && words[4] === 0xffff && words[5] === 0
  const nat64 = words[0] === 0x64 && words[1] === 0xff9b && zeros(2, 6)
  if (!mapped && !translated && !nat64) return undefined
  return [words[6] >> 8, words[6] & 255, words[7] >> 8, words[7] & 255].join('.')
}

/** The eight 16-bit words of a valid IPv6 address, `::` and a dotted IPv4 tail expanded. */
function ipv6Words(address: string): number[] {
  let text = address.replace(/%.*$/, '') // a zone, as in fe80::1%eth0
  const dotted = /(\d+)\.(\d+)\.(\d+)\.(\d+)$/.exec(text)
  if (dotted !== null) {
    const [a, b, c, d] = dotted.slice(1).map(Number)
    text = `${text.slice(0, dotted.index)}${((a << 8) | b).toString(16)}:${((c << 8) | d).toString(16)}`
  }
  const [head, tail] = text.split('::')
  const parse = (part: string | undefined) =>
    part === undefined || part === '' ? [] : part.split(':').map((word) => parseInt(word, 16))
  const [first, last] = [parse(head), parse(tail)]
  return [...first, ...new Array<number>(8 - first.length - last.length).fill(0), ...last]
}

function lookupAll(hostname: string): Promise<LookupAddress[]> {
  return lookup(hostname, { all: true, verbatim: true })
}

/**
 * How a client's pages are fetched: whether private addresses may be, and with what.
 * `hostLookups` gathers the host-name lookups the fetches start, which may outlive them (see
 * `findClient`).
 */
type FetchRules = { allowPrivate: boolean; fetch: ClientFetchOptions; hostLookups?: Promise<unknown>[] }

/**
 * Host names being resolved. `dns.lookup` cannot be cancelled, and holds one of the few threads
 * libuv gives it until the system's resolver gives up, which may be long after a fetch gave up
 * on it: made-up names on a resolver that never answers would queue every later lookup behind
 * them. So a lookup counts until it settles, and past `MAX_LOOKUPS_UNDERWAY` a fetch is refused.
 */
const lookups = { underway: 0 }
const MAX_LOOKUPS_UNDERWAY = 8

function resolveHost(hostname: string, options: FetchRules, deadline: AbortSignal, timeoutMs: number) {
  if (lookups.underway >= MAX_LOOKUPS_UNDERWAY)
    return Promise.reject(new DiscoveryBusy('too many host names are being resolved at once'))
  lookups.underway++
  // an app's lookup that throws, or returns no promise, still settles, and gives its place back
  const resolving = Promise.resolve().then(() => (options.fetch.lookup ?? lookupAll)(hostname))
  const settled = () => void lookups.underway--
  resolving.then(settled, settled)
  options.hostLookups?.push(resolving)
  return withDeadline(resolving, deadline, timeoutMs)
}

type Fetched = { type: string; link: string; headers: IncomingHttpHeaders; body: Buffer }

/** Interim answers (100 Continue, 103 Early Hints) a page may send before its own: Latch asks for none. */
const MAX_INTERIM_ANSWERS = 4
/** Besides the body, a fetch may read this and a quarter of the body's cap: the head, and a chunked body's framing. */
const FETCH_HEAD_BYTES = 32 * 1024

/** When a discovery gives up, and how long it was given, which the reasons it gives up name. */
type Deadline = { signal: AbortSignal; timeoutMs: number }

/**
 * Fetches a URL under the rules above: resolve, check every address, connect to the checked
 * one, no redirects, a deadline and a body cap. Throws an Error whose message says why not.
 */
async function fetchSafely(url: URL, maxBytes: number, options: FetchRules, until: Deadline): Promise<Fetched> {
  if (url.protocol !== 'https:' && url.protocol !== 'http:') throw new Error('it is not an http or https URL')
  const hostname = unbracketed(url.hostname)
  const { signal: deadline, timeoutMs } = until
  // out of time, which the server's own load may cause (see `withDeadline`): not the client's failure
  const outOfTime = () => new DiscoveryBusy(`it did not answer within ${timeoutMs} ms`)
  if (deadline.aborted) throw outOfTime()
  const addresses =
    isIP(hostname) !== 0
      ? [{ address: hostname, family: isIP(hostname) }]
      : await resolveHost(hostname, options, deadline, timeoutMs)
  if (addresses.length === 0) throw new Error(`its host ${hostname} has no address`)
  for (const { address } of addresses) {
    const problem = addressProblem(address, options.allowPrivate)
    if (problem !== undefined) throw new Error(problem)
  }
  const { address, family } = addresses[0]
  const send = url.protocol === 'https:' ? httpsRequest : httpRequest
  return new Promise((resolve, reject) => {
    const request = send(url, {
      // no pool: one keyed by host and port alone could hand over a connection another part of
      // the process made to another address for the same name, past the checks above
      agent: options.fetch.agent ?? false,
      signal: deadline,
      headers: { Accept: 'application/json, text/html;q=0.9', 'User-Agent': 'Latch IndieAuth', Connection: 'close' },
      lookup: (_name, lookupOptions, callback) => {
        // Connect to the address that was checked, never to a second answer from DNS (rebinding).
        if ((lookupOptions as { all?: boolean }).all)
          (callback as (err: null, all: LookupAddress[]) => void)(null, [{ address, family }])
        else (callback as (err: null, address: string, family: number) => void)(null, address, family)
      },
    })
    // Every way out goes through `settle`, once. The deadline is watched here too: after some
    // answers (a 101) node:http drops the connection and emits nothing more, not even an error.
    // And the connection ends with the fetch, whatever the site says: in the keep-alive pool of an
    // agent given, a site trickling a byte now and then would keep it open past every deadline.
    let settled = false
    let connection: Socket | undefined
    const settle = (outcome: () => void) => {
      if (settled) return
      settled = true
      deadline.removeEventListener('abort', onDeadline)
      connection?.destroy()
      outcome()
    }
    const fail = (reason: string | Error) =>
      settle(() => {
        request.destroy()
        reject(typeof reason === 'string' ? new Error(reason) : reason)
      })
    const onDeadline = () => fail(outOfTime())
    deadline.addEventListener('abort', onDeadline, { once: true })
    request.on('error', (err) => fail(deadline.aborted ? outOfTime() : `fetching it failed: ${err.message}`))
    // What the connection carries counts, not only the body: a page can send interim (1xx)
    // answers, or a chunk of one byte behind kilobytes of chunk extensions, without end.
    let interim = 0
    request.on('information', () => {
      if (++interim > MAX_INTERIM_ANSWERS) fail(`it sent more than ${MAX_INTERIM_ANSWERS} interim (1xx) answers`)
    })
    request.on('upgrade', (_response, socket) => {
      socket.destroy()
      fail('it answered 101, and only 200 counts')
    })
    const carried = { bytes: 0, most: maxBytes + maxBytes / 4 + FETCH_HEAD_BYTES }
    const count = (chunk: Buffer) => {
      carried.bytes += chunk.length
      if (carried.bytes > carried.most) fail(`it sent more than ${carried.most / 1024} KiB, counting its HTTP framing`)
    }
    request.on('socket', (socket) => {
      connection = socket
      socket.on('data', count)
    })
    request.on('response', (response) => {
      const status = response.statusCode ?? 0
      if (status !== 200) {
        response.destroy()
        const why = `it answered ${status}, and only 200 counts (redirects are not followed)`
        return fail(status === 429 || status >= 500 ? new ClientSiteBusy(why) : why)
      }
      const body = new Gathered()
      response.on('data', (chunk: Buffer) => {
        if (body.size + chunk.length <= maxBytes) return body.add(chunk)
        response.destroy()
        fail(`it is larger than ${maxBytes / 1024} KiB`)
      })
      response.on('error', (err) => fail(`reading it failed: ${err.message}`))
      response.on('end', () => {
        const type = (response.headers['content-type'] ?? '').split(';')[0].trim().toLowerCase()
        const link = [response.headers.link ?? ''].flat().join(', ')
        settle(() => resolve({ type, link, headers: response.headers, body: body.bytes }))
      })
    })
    request.end()
  })
}

/** Comments, as HTML ends them: `<!-->` and `<!--->` are whole ones, and `--!>` ends one too. */
const HTML_COMMENTS = /<!--(>|->|[^]*?(--!?>|$))/g

/**
 * An HTML page's text in the encoding it names, much as a browser finds it: a byte order mark,
 * then the Content-Type's charset, then the first `<meta>` that names an encoding, as the page
 * scanner reads the first 1,024 bytes: its `charset`, or the `content` of one that is
 * `http-equiv="Content-Type"`. UTF-8 if none does, or TextDecoder here cannot decode it
 * (ISO-2022-KR, which a browser shows as nothing, for one). A browser may look past 1,024 bytes
 * while it is still in the page's head, and where the scanner reads otherwise than a browser
 * (see `scanHtml`), so may this. So a page can be read in another encoding than a browser reads
 * it in, and show another name or publish other redirect URIs; it is the app's own page either
 * way.
 * @see https://html.spec.whatwg.org/multipage/parsing.html#determining-the-character-encoding
 */
function decodePage(body: Buffer, contentType: string): string {
  const bom = BOMS.find(([bytes]) => bytes.equals(body.subarray(0, bytes.length)))?.[1]
  const sent = decoderOf(bom ?? parametersOf(contentType).get('charset'))
  if (sent !== undefined) return decode(sent, body)
  for (const meta of scanHtml(body.subarray(0, 1024).toString('latin1'), META_ATTRIBUTES)) {
    if (meta.name !== 'meta') continue
    const { charset, content } = meta.attributes
    // a `content` charset counts only in a <meta http-equiv="Content-Type">
    const pragma = asciiLowerCase(meta.attributes['http-equiv'] ?? '') === 'content-type'
    const label = charset ?? (pragma && content !== undefined ? charsetOfContent(content) : undefined)
    // TextDecoder takes a label with ASCII spaces around it, as HTML's "get an encoding" does
    const named = label?.replace(/^[\t\n\f\r ]+|[\t\n\f\r ]+$/g, '').toLowerCase()
    const decoder = decoderOf(named === 'x-user-defined' ? 'windows-1252' : label)
    if (decoder === undefined) continue
    // one naming UTF-16 (or ucs-2, unicode…), which its own bytes cannot be, means UTF-8
    return decoder.encoding.startsWith('utf-16') ? body.toString('utf8') : decode(decoder, body)
  }
  return body.toString('utf8')
}

/** The Encoding Standard's "UTF-8 decode", as a browser's `fetch` reads JSON: a BOM is dropped. */
const utf8Decode = new TextDecoder()

/**
 * Bytes as text in a decoder's encoding. Node 20's TextDecoder reads windows-1252 (which ISO-8859-1
 * and ASCII name too) as Latin-1: 0x80–0x9F become control characters, where a browser shows the
 * euro sign, curly quotes and dashes. Those are put back here, and a later Node changes nothing.
 */
function decode(decoder: TextDecoder, body: Buffer): string {
  const text = decoder.decode(body)
  if (decoder.encoding !== 'windows-1252') return text
  return text.replace(/[\x80-\x9f]/g, (char) => WINDOWS_1252_HIGH[char.charCodeAt(0) - 0x80])
}

/** windows-1252's 0x80–0x9F; the five it leaves undefined stay as they are. */
const WINDOWS_1252_HIGH =
  '\u20ac\x81\u201a\u0192\u201e\u2026\u2020\u2021\u02c6\u2030\u0160\u2039\u0152\x8d\u017d\x8f' +
  '\x90\u2018\u2019\u201c\u201d\u2022\u2013\u2014\u02dc\u2122\u0161\u203a\u0153\x9d\u017e\u0178'

/**
 * The charset a `<meta http-equiv="Content-Type">`'s `content` names, as HTML extracts it: after
 * the first `charset` followed by `=`, a value in matching quotes (none if the quote is left
 * open), or up to a space or `;`.
 * @see https://html.spec.whatwg.org/multipage/urls-and-fetching.html#extracting-character-encodings-from-meta-elements
 */
function charsetOfContent(content: string): string | undefined {
  const found = /charset[\t\n\f\r ]*=[\t\n\f\r ]*/i.exec(content)
  if (found === null) return undefined
  const rest = content.slice(found.index + found[0].length)
  if (rest[0] === '"' || rest[0] === "'") {
    const close = rest.indexOf(rest[0], 1)
    return close === -1 ? undefined : rest.slice(1, close)
  }
  return /^[^\t\n\f\r ;]+/.exec(rest)?.[0]
}

/** What a `<meta>` may name its page's encoding with. */
const META_ATTRIBUTES = new Set(['charset', 'http-equiv', 'content'])

/** A decoder for an encoding's label; undefined for no label, or one TextDecoder here cannot decode. */
function decoderOf(label: string | undefined): TextDecoder | undefined {
  if (label === undefined) return undefined
  try {
    return new TextDecoder(label)
  } catch {
    return undefined
  }
}

/**
 * A media type's parameters (`text/html; charset="x"`), by lower-case name, quoted values
 * unquoted: the first of a name counts, and a quoted value left open runs to the end.
 * @see https://mimesniff.spec.whatwg.org/#parsing-a-mime-type
 */
function parametersOf(mediaType: string): Map<string, string> {
  const parameters = new Map<string, string>()
  for (const [, name, value] of mediaType.matchAll(/;\s*([^\s=;]+)=("(?:[^"\\]|\\.)*"?|[^;"]*)/g)) {
    const key = name.toLowerCase()
    if (!parameters.has(key))
      parameters.set(key, value.replace(/^"(.*?)"?$/, (_, quoted: string) => quoted.replace(/\\(.)/g, '$1')).trim())
  }
  return parameters
}

const BOMS: [Buffer, string][] = [
  [Buffer.from([0xef, 0xbb, 0xbf]), 'utf-8'],
  [Buffer.from([0xfe, 0xff]), 'utf-16be'],
  [Buffer.from([0xff, 0xfe]), 'utf-16le'],
]

/**
 * A lookup that runs out of time is taken as the server's load, not the client's fault: libuv
 * runs only two `dns.lookup`s at once, so a stranger's two names that never resolve hold up every
 * other lookup until its deadline, or so near it that the fetch then runs out of time, which
 * counts as load too. It is not remembered, and its client gets no same-host pass.
 */
function withDeadline<T>(promise: Promise<T>, deadline: AbortSignal, timeoutMs: number): Promise<T> {
  return new Promise((resolve, reject) => {
    const abort = () =>
      reject(new DiscoveryBusy(`its host name did not resolve within ${timeoutMs} ms, perhaps behind others`))
    deadline.addEventListener('abort', abort, { once: true })
    promise.then(resolve, (err: unknown) => {
      // what an app's own lookup rejects with may be anything, `null` included
      const { code, message } = (err ?? {}) as { code?: unknown; message?: unknown }
      const reason = typeof code === 'string' ? code : typeof message === 'string' ? message : 'no reason given'
      reject(new Error(`its host name does not resolve (${reason})`))
    })
  })
}

/**
 * Fetches and reads a client's information, JSON metadata or an HTML page, with its logo.
 * Throws an Error that says why when the client cannot be fetched or read.
 * @see https://indieauth.spec.indieweb.org/#client-information-discovery IndieAuth §4.2
 */
export async function discoverClient(
  clientId: string,
  options: FetchRules,
): Promise<{ info: ClientInfo; maxAgeSeconds: number }> {
  const url = new URL(clientId)
  if (isLoopbackUrl(clientId)) throw new Error(LOOPBACK_CLIENT)
  // one deadline for the document and its logo: the consent page waits for both, no longer
  const timeoutMs = options.fetch.timeoutMs ?? CLIENT_FETCH_TIMEOUT_MS
  const until = { signal: AbortSignal.timeout(timeoutMs), timeoutMs }
  const fetched = await fetchSafely(url, MAX_CLIENT_DOCUMENT_BYTES, options, until)
  const isJson = fetched.type === 'application/json' || fetched.type.endsWith('+json')
  // JSON at an https URL: a Client ID Metadata Document, which IndieAuth's JSON metadata is too
  const metadataDocument = isJson && url.protocol === 'https:'
  // a document served as text (a raw file on a code host, say; a BOM before it or not) would be
  // read as a page without redirect URIs, and the refusal would name the wrong cause; the type is
  // named if it is one
  const jsonAsText =
    !isJson && !fetched.type.includes('html') && /^(\xef\xbb\xbf)?\s*\{/.test(fetched.body.toString('latin1', 0, 64))
  if (url.protocol === 'https:' && jsonAsText) {
    const type = /^[\w.+-]{1,40}\/[\w.+-]{1,80}$/.test(fetched.type) ? fetched.type : 'another type'
    throw new InvalidClientDocument(`it is served as ${type}: it must be application/json`)
  }
  if (metadataDocument && fetched.body.length > MAX_METADATA_DOCUMENT_BYTES)
    throw new InvalidClientDocument(`it is larger than ${MAX_METADATA_DOCUMENT_BYTES / 1024} KiB`)
  const document = isJson
    ? readClientMetadata(utf8Decode.decode(fetched.body), clientId, metadataDocument)
    : readClientPage(decodePage(fetched.body, fetched.headers['content-type'] ?? ''), clientId)
  const linked = metadataDocument ? [] : readLinkHeader(fetched.link, 'redirect_uri', clientId).filter(isPlainUrl)
  const redirectUris = [...document.redirectUris, ...linked]
    .filter((uri) => uri.length <= MAX_URL_LENGTH)
    .slice(0, MAX_REDIRECT_URIS) // what a client publishes is kept, so it is bounded
  // A logo that could not be fetched leaves the page shown without it, and kept no longer than a
  // failure is remembered: a logo host down for a moment does not hide the logo for a day.
  let logoFailed = false
  const logo =
    document.logoUrl === undefined
      ? undefined
      : await fetchLogo(document.logoUrl, options, until).catch(() => void (logoFailed = true))
  const maxAgeSeconds = cacheLifetime(fetched.headers, Date.now())
  return {
    info: {
      name: document.name,
      url: document.url,
      logo,
      redirectUris,
      metadataDocument,
      documentClientId: metadataDocument ? document.clientId : undefined,
    },
    maxAgeSeconds: logoFailed ? Math.min(maxAgeSeconds, FAILED_CLIENT_MEMORY_SECONDS) : maxAgeSeconds,
  }
}

/**
 * How long a response stays fresh, in seconds, by the rules of a private cache (RFC 9111 §4.2):
 * `max-age` less `Age`, else `Expires` less `Date`; 0 for `no-store` and for `no-cache` (Latch
 * does not revalidate); at most a day, so that a change reaches Latch daily. When neither says, a
 * minute (a heuristic lifetime, §4.2.2): else a stranger asking for a client again and again would
 * have Latch fetch its page as often, until its site answered 429 and locked the app's users out.
 * @see https://www.rfc-editor.org/rfc/rfc9111#section-4.2.1
 * @see https://www.rfc-editor.org/rfc/rfc9111#section-4.2.2
 */
export function cacheLifetime(headers: IncomingHttpHeaders, now: number): number {
  // the directives, split at commas outside quoted values: `ext="a, no-store"` is one
  const directives = ((headers['cache-control'] ?? '').toLowerCase().match(/(?:[^,"]|"[^"]*")+/g) ?? []).map((one) =>
    one.trim(),
  )
  const named = (name: string) => directives.filter((one) => one.split('=')[0].trimEnd() === name)
  if (named('no-store').length > 0 || named('no-cache').length > 0) return 0
  const maxAge = named('max-age')[0]
  const age = /^\d+$/.test(headers.age ?? '') ? Number(headers.age) : 0
  // when neither says, a minute from now whatever its Age: the heuristic is the cache's to choose,
  // and one already stale would be fetched at every request
  let fresh = HEURISTIC_CLIENT_CACHE_SECONDS
  if (maxAge !== undefined) {
    // a max-age that is no number of seconds (-1, 5abc) is invalid, which makes the response stale (§4.2.1)
    const seconds = /^max-age\s*=\s*("?)(\d+)\1$/.exec(maxAge)?.[2]
    fresh = seconds === undefined ? 0 : Number(seconds) - age
  } else if (headers.expires !== undefined) {
    const expires = parseHttpDate(headers.expires)
    const date = headers.date === undefined ? now : parseHttpDate(headers.date)
    // an invalid Expires, such as "0", means already expired (§5.3)
    fresh = Number.isNaN(expires) || Number.isNaN(date) ? 0 : Math.floor((expires - date) / 1000) - age
  }
  return Math.max(0, Math.min(fresh, MAX_CLIENT_CACHE_SECONDS))
}

/**
 * An HTTP date in milliseconds, or NaN for what is none: `Date.parse` alone reads "0" and "2030"
 * as years. Each of the three forms has a time of day, and is in GMT, which the oldest (asctime's)
 * does not write.
 * @see https://www.rfc-editor.org/rfc/rfc9110#section-5.6.7 RFC 9110 §5.6.7
 */
function parseHttpDate(text: string): number {
  if (!/(^| )\d\d:\d\d:\d\d( |$)/.test(text)) return NaN
  return Date.parse(text.endsWith(' GMT') ? text : `${text} GMT`)
}

const LOOPBACK_CLIENT = 'it is a loopback address, which IndieAuth forbids fetching'

type HtmlElement = { name: string; attributes: Record<string, string>; textStart: number; textEnd: number; end: number }

const VOID_ELEMENTS = new Set([
  'area',
  'base',
  'br',
  'col',
  'embed',
  'hr',
  'img',
  'input',
  'link',
  'meta',
  'source',
  'track',
  'wbr',
])
const MAX_HTML_ELEMENTS = 10_000
const MAX_HTML_CLOSING_TAGS = 10_000
const MAX_OPEN_ELEMENTS = 256
/**
 * Where the text of an element whose text holds no markup ends: its end tag, in upper or lower
 * case, its name followed by a space, `/` or `>`. A `<link>` written in a `<textarea>`, a
 * `<title>` or a `<noscript>` (read by a browser that runs scripts) is text, as in a browser.
 * The scanner knows no SVG or MathML (whose `<title>` holds markup, and whose `<link>` is no
 * HTML link), no `<frameset>` (after which a browser reads no start tag), no end tag a browser
 * implies (`<p>` before a `<div>`), nor a script's `<!--<script>`, which a browser ends only at a
 * second `</script>`: there it reads other links or another name than a browser.
 */
const RAW_TEXT_ENDS: Record<string, RegExp> = Object.fromEntries(
  ['script', 'style', 'title', 'textarea', 'xmp', 'iframe', 'noembed', 'noframes', 'noscript'].map((name) => [
    name,
    new RegExp(`</${name}[\\t\\n\\f\\r />]`, 'gi'),
  ]),
)
RAW_TEXT_ENDS.plaintext = /(?!)/g // it never ends

/**
 * A small HTML scanner, enough for microformats: every start tag in order, with the attributes
 * asked for, where its text starts and ends, and the index just past its last descendant.
 * Comments (and what HTML takes for them: `<!DOCTYPE …>`, `<?…>`) are skipped, the text of a
 * script, a style, a title, a text area and the like is read as text, not markup, and what a
 * `<template>` holds is kept out, as it is not in the page. The work is linear in the page,
 * however hostile: each character is read a bounded number of times, a closing tag looks among
 * the open elements only when one of its name is open (and each element is closed once), and the
 * scan stops at 10,000 start tags or 10,000 closing tags.
 */
export function scanHtml(html: string, read = READ_ATTRIBUTES): HtmlElement[] {
  const elements: HtmlElement[] = []
  const open: number[] = [] // the elements not closed yet, outermost first
  const openByName = new Map<string, number>() // how many of `open` have each name
  let inTemplates = 0 // how many `<template>`s are open: what they hold is not in the page
  let closingTags = 0
  let at = 0
  while (elements.length < MAX_HTML_ELEMENTS && closingTags < MAX_HTML_CLOSING_TAGS) {
    const lt = html.indexOf('<', at)
    if (lt === -1) break
    TAG_NAME.lastIndex = lt + 1
    const named = TAG_NAME.exec(html)
    if (named === null) {
      at = markupEnd(html, lt) // a comment, what HTML takes for one, or a `<` that is text
      continue
    }
    const tag = readTag(html, TAG_NAME.lastIndex, read)
    if (tag === undefined) break // no tag can end after this point
    at = tag.end + 1
    const name = asciiLowerCase(named[0].replace('/', '')) // as HTML does: `linK` (a Kelvin sign) is no link
    const close = Object.hasOwn(RAW_TEXT_ENDS, name) ? RAW_TEXT_ENDS[name] : undefined
    if (named[0].startsWith('/')) {
      closingTags++
      if (inTemplates > 0) {
        if (name === 'template') inTemplates--
        continue
      }
      if ((openByName.get(name) ?? 0) === 0) continue // nothing to close: no search
      const index = open.findLastIndex((element) => elements[element].name === name)
      for (const element of open.splice(index)) {
        openByName.set(elements[element].name, (openByName.get(elements[element].name) ?? 1) - 1)
        elements[element].end = elements.length
        elements[element].textEnd = lt
      }
      continue
    }
    if (name === 'template' || inTemplates > 0) {
      // a template's content is read as markup, to find where it ends, but kept out of the page
      if (name === 'template') inTemplates++
      else if (close !== undefined) {
        close.lastIndex = at
        at = close.exec(html)?.index ?? html.length
      }
      continue
    }
    elements.push({
      name,
      attributes: tag.attributes,
      textStart: at,
      textEnd: at,
      end: elements.length + 1,
    })
    if (close !== undefined) {
      // text, not markup, up to its end tag: sought in `html` itself, since a lower-case copy
      // may be longer (`İ` becomes two characters), and its places not the same
      close.lastIndex = at
      at = close.exec(html)?.index ?? html.length
      elements[elements.length - 1].textEnd = at
    } else if (!VOID_ELEMENTS.has(name) && open.length < MAX_OPEN_ELEMENTS) {
      // a `/` before the `>` closes nothing: HTML ignores it (`<div/>` is `<div>`)
      open.push(elements.length - 1)
      openByName.set(name, (openByName.get(name) ?? 0) + 1)
    }
  }
  for (const element of open) {
    elements[element].end = elements.length
    elements[element].textEnd = html.length
  }
  return elements
}

/**
 * Reads a tag from just past its name to its `>`, as HTML's tokenizer does: an attribute's name
 * runs to a space, `/`, `>` or `=` (a quote in it is part of it, and so is an `=` it starts
 * with), and only a value may be quoted. Returns where the tag ends and the attributes asked
 * for (by default those discovery reads; the first of a name counts, and one without a value has
 * an empty one); undefined for a tag the page never ends.
 * @see https://html.spec.whatwg.org/multipage/parsing.html#before-attribute-name-state
 */
function readTag(
  html: string,
  from: number,
  read = READ_ATTRIBUTES,
): { end: number; attributes: Record<string, string> } | undefined {
  const attributes: Record<string, string> = {}
  let at = from
  for (;;) {
    while (at < html.length && (isHtmlSpace(html[at]) || html[at] === '/')) at++ // between attributes
    if (at === html.length) return undefined
    if (html[at] === '>') return { end: at, attributes }
    const nameStart = at++
    while (at < html.length && !isHtmlSpace(html[at]) && html[at] !== '/' && html[at] !== '>' && html[at] !== '=') at++
    const name = asciiLowerCase(html.slice(nameStart, at))
    let equals = at
    while (equals < html.length && isHtmlSpace(html[equals])) equals++
    if (html[equals] !== '=') {
      // an attribute without a value has an empty one, and a later one of its name is ignored
      if (read.has(name) && !Object.hasOwn(attributes, name)) attributes[name] = ''
      continue
    }
    for (at = equals + 1; at < html.length && isHtmlSpace(html[at]);) at++
    let value: string
    const quote = html[at]
    if (quote === '"' || quote === "'") {
      const close = html.indexOf(quote, at + 1)
      if (close === -1) return undefined
      value = html.slice(at + 1, close)
      at = close + 1
    } else {
      const valueStart = at
      while (at < html.length && !isHtmlSpace(html[at]) && html[at] !== '>') at++
      value = html.slice(valueStart, at)
    }
    if (read.has(name) && !Object.hasOwn(attributes, name)) attributes[name] = decodeEntities(value)
  }
}

/** HTML's white space: not Unicode's, so a no-break space is part of a name or a value. */
function isHtmlSpace(char: string): boolean {
  return char === ' ' || char === '\n' || char === '\t' || char === '\f' || char === '\r'
}

/** Lower case for ASCII letters only, as HTML folds names: `K` (Kelvin) is not `k`. */
function asciiLowerCase(text: string): string {
  return /[A-Z]/.test(text) ? text.replace(/[A-Z]+/g, (letters) => letters.toLowerCase()) : text // most are lower
}

/**
 * The text of an element, tags taken out, entities decoded, white space folded. At most 2,000
 * characters are read, and a tag that limit cuts in two is dropped, not shown.
 */
function elementText(html: string, element: HtmlElement): string {
  const end = Math.min(element.textEnd, element.textStart + 2_000)
  const text = html.slice(element.textStart, end)
  return htmlText(end < element.textEnd ? text.replace(/<\/?$/, '') : text) // a cut `</` may be a tag's start
}

/** The attributes discovery reads; the rest are passed over, so a tag of many costs little. */
const READ_ATTRIBUTES = new Set(['class', 'rel', 'href', 'src'])

/**
 * Text much as a browser shows it: markup out (a tag or comment left open runs to the end),
 * entities decoded. It knows no raw text nor templates: a `<textarea>` in a name loses what looks
 * like tags in it, and a `<template>`'s text is shown.
 */
function htmlText(html: string): string {
  let text = ''
  let at = 0
  for (let lt = html.indexOf('<'); lt !== -1; lt = html.indexOf('<', at)) {
    const end = markupEnd(html, lt)
    text += `${html.slice(at, lt)}${end === lt + 1 ? '<' : ' '}` // a bare `<` is text, as in `I <3 it`
    at = end
  }
  return decodeEntities(text + html.slice(at))
    .replace(/\s+/g, ' ')
    .trim()
}

/**
 * Where the markup that starts at a `<` ends: past a comment (one left open runs to the end), past
 * what HTML takes for one (`<!DOCTYPE …>`, `<?…?>`, `</3…>`, ended by the next `>`), or past a
 * tag, whose quoted values may hold a `>`; just past the `<` when it starts none.
 */
function markupEnd(html: string, lt: number): number {
  if (html.startsWith('<!--', lt)) {
    HTML_COMMENTS.lastIndex = lt // it matches here
    return lt + (HTML_COMMENTS.exec(html)?.[0].length ?? html.length)
  }
  const next = html[lt + 1] ?? ''
  if (next === '!' || next === '?' || (next === '/' && /^[^a-zA-Z]/.test(html[lt + 2] ?? ''))) {
    const end = html.indexOf('>', lt + 2)
    return end === -1 ? html.length : end + 1
  }
  TAG_NAME.lastIndex = lt + 1
  if (TAG_NAME.exec(html) === null) return lt + 1
  return (readTag(html, TAG_NAME.lastIndex)?.end ?? html.length) + 1
}

/** A tag's name, from just past its `<`: it runs to a space, `/` or `>`, as in HTML. */
const TAG_NAME = /\/?[a-zA-Z][^\t\n\f\r />]*/y

/**
 * Decodes character references as HTML does: a number (0x80–0x9F taken as windows-1252, as a
 * browser takes them; 0, a surrogate or past Unicode as U+FFFD), or a name, in its case
 * (`&AMP;` is one, `&Amp;` none). The names known are those of Latin-1 and windows-1252, which
 * old pages use; a name of another character is left as written.
 * @see https://html.spec.whatwg.org/multipage/parsing.html#numeric-character-reference-end-state
 */
function decodeEntities(text: string): string {
  return text.replace(/&(?:#[xX]([0-9a-fA-F]+)|#(\d+)|([A-Za-z][A-Za-z0-9]*));/g, (entity, hex, decimal, name) => {
    if (name !== undefined) return NAMED_CHARACTERS.get(name) ?? entity
    const code = hex === undefined ? Number(decimal) : parseInt(hex, 16)
    if (code >= 0x80 && code <= 0x9f) return WINDOWS_1252_HIGH[code - 0x80]
    return code === 0 || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff) ? '\ufffd' : String.fromCodePoint(code)
  })
}

/**
 * The named characters `decodeEntities` knows: ASCII's five (some in capitals too), Latin-1's
 * from U+00A0, windows-1252's.
 */
const NAMED_CHARACTERS = new Map<string, string>([
  ...Object.entries({ amp: '&', lt: '<', gt: '>', quot: '"', apos: "'" }),
  ...Object.entries({ AMP: '&', LT: '<', GT: '>', QUOT: '"', COPY: '\u00a9', REG: '\u00ae', TRADE: '\u2122' }),
  ...(
    'nbsp iexcl cent pound curren yen brvbar sect uml copy ordf laquo not shy reg macr deg plusmn sup2 sup3 ' +
    'acute micro para middot cedil sup1 ordm raquo frac14 frac12 frac34 iquest Agrave Aacute Acirc Atilde Auml ' +
    'Aring AElig Ccedil Egrave Eacute Ecirc Euml Igrave Iacute Icirc Iuml ETH Ntilde Ograve Oacute Ocirc Otilde ' +
    'Ouml times Oslash Ugrave Uacute Ucirc Uuml Yacute THORN szlig agrave aacute acirc atilde auml aring aelig ' +
    'ccedil egrave eacute ecirc euml igrave iacute icirc iuml eth ntilde ograve oacute ocirc otilde ouml divide ' +
    'oslash ugrave uacute ucirc uuml yacute thorn yuml'
  )
    .split(' ')
    .map((name, i): [string, string] => [name, String.fromCharCode(0xa0 + i)]),
  ...(
    'euro - sbquo fnof bdquo hellip dagger Dagger circ permil Scaron lsaquo OElig - Zcaron - ' +
    '- lsquo rsquo ldquo rdquo bull ndash mdash tilde trade scaron rsaquo oelig - zcaron Yuml'
  )
    .split(' ')
    .map((name, i): [string, string] => [name, WINDOWS_1252_HIGH[i]])
    .filter(([name]) => name !== '-'),
])

function hasToken(list: string | undefined, token: string): boolean {
  return asciiLowerCase(list ?? '')
    .split(/[\t\n\f\r ]+/)
    .includes(token) // HTML's spaces, not Unicode's
}

/**
 * A URL of a page's markup, resolved: none where it still holds a character's name after
 * `decodeEntities`, which knows only a few. A browser reads another character there (`&sol;` is
 * `/`), and so may find another host in it than Latch would.
 */
function resolveLink(href: string, pageUrl: string): string | undefined {
  return /&[A-Za-z][A-Za-z0-9]*;/.test(href) ? undefined : resolveUrl(href, pageUrl)
}

function resolveUrl(href: string, base: string): string | undefined {
  // not `trim()`: the URL parser strips C0 controls and spaces, and a no-break space is part of the URL
  return URL.canParse(href, base) ? new URL(href, base).href : undefined
}

/**
 * A name as the consent page shows it: one line of plain text (`plainText`), at most 100
 * characters. A copy: a name cut from a page would otherwise keep the whole page in memory.
 */
export function cleanName(name: string): string | undefined {
  const clean = plainText(name)
    .slice(0, 100)
    .replace(/[\ud800-\udbff]$/, '') // not half a character cut by the slice
  return clean === '' ? undefined : detached(clean)
}

/**
 * Text on one line, without control or formatting characters, so that right-to-left overrides,
 * isolates and invisible marks cannot disguise what a stranger chose; letters that show nothing
 * (the Braille blank, the Hangul fillers) are one space, so that they cannot push what follows
 * a name out of view either.
 */
function plainText(text: string): string {
  return text
    .replace(/[\s\p{Cc}\p{Zl}\p{Zp}\u115f\u1160\u2800\u3164\uffa0]+/gu, ' ') // and letters that show nothing
    .replace(/\p{Cf}/gu, '') // bidi overrides, isolates and marks, zero-width characters
    .trim()
}

/** Fetches a logo under the same rules, and inlines it: images only, at most 64 KiB. */
async function fetchLogo(logoUrl: string, options: FetchRules, until: Deadline): Promise<string | undefined> {
  if (isLoopbackUrl(logoUrl)) return undefined
  const fetched = await fetchSafely(new URL(logoUrl), MAX_LOGO_BYTES, options, until)
  if (!LOGO_TYPES.has(fetched.type)) return undefined
  return `data:${fetched.type};base64,${fetched.body.toString('base64')}`
}

// --- Storage --------------------------------------------------------------------
// A `Store` keeps pending requests, codes, grants and tokens under the hashes of their ids, and
// the owner's passkeys under their credential ids.
// This one keeps them in Maps. Every read checks expiry, and a timer sweeps expired entries away
// a few thousand at a time, between requests, so no request pays for expiry. (The owner's
// `/apps` lists every grant, and so walks them all; no client's request does.) Pending
// requests, codes and sessions each live equally long, so a Map's insertion order is already
// their order of expiry: the sweep takes them from the front. (A lifetime shortened between
// starts leaves older entries behind the sweep's front for a while: reads still hide them.)
// Grants and tokens need not; the sweep walks them in turn, a few thousand steps a time.
// To put SQLite or Redis behind Latch, implement `Store`: twenty-four small methods.
//
// On SQL, each kind is a table keyed by hash with an `expires_at` column, and the two atomic steps
// are one statement each: `UPDATE ... SET used_at = ? WHERE hash = ? AND used_at IS NULL AND
// expires_at > ?` (one row changed: the first caller), in a transaction with the inserts of the
// grant and the tokens; a refresh token's `UPDATE` also wants its grant not revoked (revoked
// since Latch found it). A refresh token's retry within the grace period is the one exception:
// its condition is `hash = ? AND expires_at > ? AND (used_at IS NULL OR (used_at >=
// <retriedSince> AND hash = <its grant's last_rotated>))`, with `SET used_at = COALESCE(used_at,
// ?)` so that a retry does not move it; each first redemption of a refresh token sets its grant's
// `last_rotated`. `revokeGrant` deletes the grant and inserts it into a table of revoked ids;
// `revokeApprovedBy` does that for every grant approved by a time and every code issued by then,
// and deletes those codes, in one transaction. On Redis, each entry is a key with a TTL, and the
// same step is a `WATCH`/`MULTI` or a small Lua script.
//
// A write the database refused (full, or unreachable) is thrown as `NotStored`, once its cause is
// logged: the client is told 500 `server_error`, and nothing happened (a `touchGrant` that fails
// this way still lets the token through). Any other error is a fault, answered 500 too, with its
// stack in the log. Every call must settle, the database reachable or not: give its driver a
// timeout (a few seconds), as Latch waits for the store as long as it takes, and a request
// waiting on a call that never settles is never answered, and keeps its memory. `findSession` may
// be asked for up to 300 sessions at once, for the cookies of one request on http, and 4 on https
// (`findOwnerSession`).
// What a store returns has each field a type says may be missing as `undefined`, never `null`:
// turn a NULL column into `undefined` (Latch reads `usedAt !== undefined` as "used"). Latch sweeps
// expired entries out of its own two stores; one of your own expires them itself (a TTL, or a
// periodic `DELETE ... WHERE expires_at < ?`).

/** Options of the in-memory store: caps so that a flood cannot grow memory without limit. */
export type MemoryStoreOptions = {
  maxPendingRequests?: number
  maxCodes?: number
  log?: (line: string) => void
}

const REVOKED_GRANT_MEMORY_SECONDS = 86_400

/** The in-memory `Store`: Maps with expiry timestamps, bounded where a stranger could fill them. */
export class MemoryStore implements Store {
  readonly pending = new Map<string, PendingRequest>()
  readonly codes = new Map<string, AuthorizationCode>()
  readonly grants = new ExpiringMap<StoredGrant>()
  readonly tokens = new ExpiringMap<StoredToken>()
  /** Grants revoked, kept until their tokens would have expired, so that no late save revives them. */
  readonly revokedGrants = new ExpiringMap<{ expiresAt: number }>()
  readonly sessions = new Map<string, Session>()
  /** The owner's passkeys by credential id, in the order they were added. */
  readonly passkeys = new Map<string, Passkey>()
  readonly #maxPendingRequests: number
  readonly #maxCodes: number
  readonly #log: (line: string) => void
  readonly #shared = new Map<string, string[] | GrantedApp>()
  /** How many pending requests each address opened (`PendingRequest.openedBy`), for a full store to choose from. */
  readonly #pendingBy = new Map<string | undefined, number>()
  #lastApp: GrantedApp | undefined
  #lastScope: string[] | undefined
  #lastResource: string[] | undefined
  readonly #dropped = new Map<string, number>()
  /** Grants and tokens saved that the sweep has not yet walked twice as many entries for. */
  #savedSinceSweep = 0
  /** Whether a token's grant is gone (revoked, or expired): the token is dead, and a snapshot leaves it out. */
  readonly #grantGone = (token: StoredToken): boolean => !this.grants.has(token.grantId)
  /**
   * Whether a token's grant was revoked: the token is dead, and the sweep takes it. A grant lasts
   * as long as the last token it issued (`issueTokens`), so the tokens of an expired grant have
   * expired too; and the grants revoked are few, where a look in all the grants cost the sweep
   * of a busy server more than anything else it does.
   */
  readonly #grantRevoked = (token: StoredToken): boolean => this.revokedGrants.has(token.grantId)
  /**
   * The refresh tokens each refresh token's rotations issued (two, for two refreshes sent at once),
   * while a retry of it may still come: the longest grace and a second. Kept in memory only: after
   * a restart, or past the last `MAX_RECENT_ROTATIONS`, a retry is known by `lastRotated` alone.
   */
  readonly #rotatedTo = new Map<string, { at: number; issued: string[] }>()

  constructor(options: MemoryStoreOptions = {}) {
    this.#maxPendingRequests = options.maxPendingRequests ?? 1_000
    this.#maxCodes = options.maxCodes ?? 10_000
    this.#log = neverThrowing(options.log ?? console.log)
  }

  async savePending(id: string, request: PendingRequest, _now: number): Promise<void> {
    if (this.pending.size >= this.#maxPendingRequests) {
      this.#forgetPending(this.#oldestOfBusiest() ?? '')
      this.#countDrop(this.#maxPendingRequests, 'pending authorization requests')
    }
    this.#forgetPending(id)
    this.pending.set(id, request)
    this.#pendingBy.set(request.openedBy, (this.#pendingBy.get(request.openedBy) ?? 0) + 1)
  }

  /**
   * The request a full store drops: the oldest of the address that opened the most. Dropping the
   * oldest of all let one stranger, with a thousand requests, push out the consent page the owner
   * was answering; now a flood pushes out its own, unless it comes from as many addresses as the
   * store holds requests. Behind a proxy that TRUST_PROXY does not name, every request is the
   * proxy's, and the oldest of all goes, as before. It walks the addresses' counts, then the
   * requests up to the first of that address: most often the first of all.
   */
  #oldestOfBusiest(): string | undefined {
    let busiest: string | undefined
    let most = 0
    for (const [openedBy, count] of this.#pendingBy) if (count > most) [busiest, most] = [openedBy, count]
    for (const [id, { openedBy }] of this.pending) if (openedBy === busiest) return id
    return undefined
  }

  /** Deletes a pending request, and counts it off the address that opened it. */
  #forgetPending(id: string): void {
    const request = this.pending.get(id)
    if (request === undefined) return
    this.pending.delete(id)
    const left = (this.#pendingBy.get(request.openedBy) ?? 1) - 1
    if (left === 0) this.#pendingBy.delete(request.openedBy)
    else this.#pendingBy.set(request.openedBy, left)
  }

  async findPending(id: string, now: number): Promise<PendingRequest | undefined> {
    return live(this.pending.get(id), now)
  }

  async takePending(id: string, now: number): Promise<PendingRequest | undefined> {
    const request = live(this.pending.get(id), now)
    this.#forgetPending(id)
    return request
  }

  async saveCode(hash: string, code: AuthorizationCode, _now: number): Promise<void> {
    if (!this.codes.has(hash)) this.#makeRoom(this.codes, this.#maxCodes, 'authorization codes')
    this.codes.set(hash, code)
  }

  async findCodeUsedOrNot(hash: string, now: number): Promise<AuthorizationCode | undefined> {
    return live(this.codes.get(hash), now)
  }

  async markCodeUsed(hash: string, now: number): Promise<boolean> {
    return this.redeem({ kind: 'code', hash }, now) !== undefined
  }

  async saveGrant(id: string, grant: Grant, _now: number): Promise<void> {
    this.#putGrant(id, grant)
  }

  async findGrant(id: string, now: number): Promise<Grant | undefined> {
    const stored = this.grants.get(id)
    return stored !== undefined && stored.expiresAt * 1000 > now ? stored.toGrant() : undefined
  }

  async listGrants(now: number): Promise<[string, Grant][]> {
    const grants: [string, Grant][] = []
    for (const [id, stored] of this.grants) if (stored.expiresAt * 1000 > now) grants.push([id, stored.toGrant()])
    return grants.sort(([, a], [, b]) => a.approvedAt - b.approvedAt)
  }

  /**
   * `until`, in milliseconds, is how long a journal's compacted line says to remember the grant,
   * whose own line is gone by then: that long, not a day from each start that reads it. A grant
   * revoked again is remembered no shorter.
   */
  async revokeGrant(id: string, now: number, until?: number): Promise<void> {
    const expiresAt = Math.max(
      this.grants.get(id)?.expiresAt ?? 0,
      this.revokedGrants.get(id)?.expiresAt ?? 0,
      until === undefined ? toSeconds(now) + REVOKED_GRANT_MEMORY_SECONDS : toSeconds(until),
    )
    this.revokedGrants.set(id, { expiresAt })
    this.grants.delete(id) // its tokens die with it: every lookup checks the grant, and the sweep removes them
  }

  async revokeApprovedBy(approvedBy: number, now: number): Promise<number> {
    const { records, apps } = this.approvedBy(approvedBy, now)
    for (const record of records) await applyRecord(this, record, now)
    return apps
  }

  /** What `revokeApprovedBy` deletes, as journal records, and how many apps lose their access by it. */
  approvedBy(approvedBy: number, now: number): { records: JournalRecord[]; apps: number } {
    const by = toSeconds(approvedBy)
    const grants = new Set<string>()
    const clients = new Set<string>() // of the apps yet to redeem a code: one of them may hold several
    let apps = 0
    for (const [id, stored] of this.grants) {
      if (stored.expiresAt * 1000 <= now || stored.approvedAt > by) continue
      apps++
      grants.add(id)
      clients.add(stored.app.client_id)
    }
    const codes: JournalRecord[] = []
    for (const [hash, code] of this.codes) {
      if (code.expiresAt <= now || toSeconds(code.issuedAt) > by) continue
      codes.push({ delete: 'code', key: hash })
      grants.add(hash) // the grant an exchange of it is making now, or will
      // an app yet to redeem its code, unless it is counted: a double click leaves one unredeemed
      if (code.usedAt === undefined && !clients.has(code.client_id)) apps++
      clients.add(code.client_id)
    }
    return { records: [...codes, ...[...grants].map((key) => ({ delete: 'grant', key }) as const)], apps }
  }

  async touchGrant(id: string, now: number): Promise<void> {
    const stored = this.grants.get(id)
    if (stored !== undefined) stored.lastUsedAt = toSeconds(now)
  }

  async saveToken(hash: string, token: Token, _now: number): Promise<void> {
    this.#putToken(hash, token)
  }

  async findToken(hash: string, now: number): Promise<Token | undefined> {
    const stored = this.tokens.get(hash)
    return stored !== undefined && stored.expiresAt * 1000 > now ? stored.toToken() : undefined
  }

  async redeemForTokens(issue: TokenIssue, now: number): Promise<boolean> {
    const redemption = this.redeem(issue.redeemed, now)
    if (redemption === undefined) return false
    this.keepIssued(issue, redemption)
    return true
  }

  /** Saves the grant and the tokens of an issue already redeemed, the first time or `again`. */
  keepIssued(issue: TokenIssue, redemption: 'first' | 'again'): void {
    const { redeemed, grantId, grant } = issue
    // which token was rotated last is as `redeem` left it: a copy saved after a later rotation must not undo it
    const lastRotated = redeemed.kind === 'refresh' ? this.grants.get(grantId)?.lastRotated : undefined
    this.#putGrant(grantId, grant, lastRotated ?? grant.lastRotated)
    for (const [hash, token] of issue.tokens) {
      this.#putToken(hash, token)
      if (redeemed.kind === 'refresh' && token.kind === 'refresh')
        this.#noteRotation(redeemed.hash, hash, token.issuedAt, redemption)
    }
  }

  /**
   * Notes the refresh token a rotation issued, and forgets those past any retry's time. A retry's
   * is noted only if its first rotation's is: after a restart the first is unknown, the list would
   * be incomplete, and `redeem` must fall back on the grant's `lastRotated`.
   */
  #noteRotation(rotated: string, issued: string, at: number, redemption: 'first' | 'again'): void {
    for (const [hash, rotation] of this.#rotatedTo) {
      const retryOver = rotation.at < at - (MAX_REFRESH_GRACE_SECONDS + 1) * 1000
      if (!retryOver && this.#rotatedTo.size < MAX_RECENT_ROTATIONS) break // kept in the order they came
      this.#rotatedTo.delete(hash)
    }
    const rotation = this.#rotatedTo.get(rotated)
    if (rotation !== undefined) rotation.issued.push(issued)
    else if (redemption === 'first') this.#rotatedTo.set(rotated, { at, issued: [issued] })
  }

  /**
   * Marks an unexpired, unused code or refresh token used, in one step: `first` for the first
   * caller, `again` for a retry that `retriedSince` allows, undefined for any other.
   */
  redeem(redeemed: TokenIssue['redeemed'], now: number): 'first' | 'again' | undefined {
    if (redeemed.kind === 'code') {
      const code = live(this.codes.get(redeemed.hash), now)
      // a replay revokes the grant named for the code, even while its first redemption is being written
      if (code === undefined || code.usedAt !== undefined || this.revokedGrants.has(redeemed.hash)) return undefined
      code.usedAt = now
      return 'first'
    }
    const stored = this.tokens.get(redeemed.hash)
    if (stored === undefined || stored.expiresAt * 1000 <= now) return undefined
    const grant = this.grants.get(stored.grantId)
    if (grant === undefined) return undefined // revoked since the token was found: no tokens of it
    if (stored.usedAt === undefined) {
      stored.usedAt = toSeconds(now)
      grant.lastRotated = redeemed.hash // now: a retry may come before the grant is saved
      return 'first'
    }
    const since = redeemed.retriedSince
    // a retry comes within the grace period (`usedAt` is in whole seconds, rounded down), and while
    // the client has not gone on from the token: none of the refresh tokens its rotations issued is
    // used yet. Two refreshes sent at once make two, each of which a tab may go on with. When the
    // successors are not known, only the grant's `lastRotated` may be retried (any token, for a
    // grant saved before Latch kept `lastRotated`)
    if (since === undefined || (stored.usedAt + 1) * 1000 <= since) return undefined
    const issued = this.#rotatedTo.get(redeemed.hash)?.issued
    const goneOn =
      issued === undefined
        ? (grant.lastRotated ?? redeemed.hash) !== redeemed.hash
        : issued.some((hash) => this.tokens.get(hash)?.usedAt !== undefined)
    return goneOn ? undefined : 'again'
  }

  /**
   * Takes back a first `redeem`, for a durable store that could not write it down; a refresh
   * token's grant gets back `rotatedBefore`, the token it rotated last before (`rotatedLastBefore`).
   */
  unredeem(redeemed: TokenIssue['redeemed'], rotatedBefore: string | undefined): void {
    if (redeemed.kind === 'code') {
      const code = this.codes.get(redeemed.hash)
      if (code !== undefined) code.usedAt = undefined
      return
    }
    const token = this.tokens.get(redeemed.hash)
    if (token === undefined) return
    token.usedAt = undefined
    const grant = this.grants.get(token.grantId)
    if (grant?.lastRotated === redeemed.hash) grant.lastRotated = rotatedBefore
  }

  /** For a refresh token about to be redeemed: the token its grant rotated last until now. */
  rotatedLastBefore(redeemed: TokenIssue['redeemed']): string | undefined {
    if (redeemed.kind === 'code') return undefined
    return this.grants.get(this.tokens.get(redeemed.hash)?.grantId ?? '')?.lastRotated
  }

  async deleteToken(hash: string): Promise<void> {
    this.tokens.delete(hash)
  }

  async saveSession(hash: string, session: Session, _now: number): Promise<void> {
    this.sessions.set(hash, session)
  }

  async findSession(hash: string, now: number): Promise<Session | undefined> {
    return live(this.sessions.get(hash), now)
  }

  async deleteSession(hash: string): Promise<void> {
    this.sessions.delete(hash)
  }

  async deleteAllSessions(): Promise<void> {
    this.sessions.clear()
  }

  async savePasskey(id: string, passkey: Passkey, _now: number): Promise<void> {
    this.passkeys.set(id, { ...passkey })
  }

  async findPasskey(id: string): Promise<Passkey | undefined> {
    const passkey = this.passkeys.get(id)
    return passkey === undefined ? undefined : { ...passkey }
  }

  async listPasskeys(): Promise<[string, Passkey][]> {
    return [...this.passkeys].map(([id, passkey]) => [id, { ...passkey }])
  }

  async deletePasskey(id: string): Promise<void> {
    this.passkeys.delete(id)
  }

  /** Nothing to let go of: here so that one shutdown closes whichever store `openStore` gave. */
  async close(): Promise<void> {}

  /**
   * Deletes expired entries, up to `budget` of each kind: the one way they go. `createHandler`
   * calls it every 100 ms, between requests, and no write does, so the token path never pays for
   * it. By default a call walks at least 2,000 entries, and twice as many grants and tokens as
   * were saved and not yet walked for, so that the walk keeps pace with the writes; but at most
   * 6,000, a few milliseconds: after a burst of saves (a start that replays a million tokens), the
   * walk catches up over the next calls instead of stalling the server for one long one.
   */
  sweep(now: number, budget = this.#sweepBudget()): void {
    this.#savedSinceSweep = Math.max(0, this.#savedSinceSweep - budget / 2)
    let swept = 0
    for (const [id, request] of this.pending) {
      if (request.expiresAt > now || swept++ === budget) break
      this.#forgetPending(id)
    }
    sweepOldest(this.codes, now, budget)
    sweepOldest(this.sessions, now, budget)
    this.grants.sweep(now, budget)
    this.revokedGrants.sweep(now, budget)
    this.tokens.sweep(now, budget, this.#grantRevoked)
  }

  /**
   * The records that rebuild this store's unexpired codes, grants, tokens and sessions, and its passkeys: a
   * snapshot for the journal. Codes and refresh tokens in `unsaved` were marked used by a
   * redemption whose write has not yet succeeded, and are written as unused, and a grant whose
   * `lastRotated` is one of them is written with the value it had before (the map's value): the
   * redemption's own line follows the snapshot if it succeeds.
   */
  *records(now: number, unsaved: ReadonlyMap<string, string | undefined> = new Map()): Iterable<JournalRecord> {
    for (const [key, value] of this.codes) {
      if (value.expiresAt > now)
        yield { set: 'code', key, value: unsaved.has(key) ? { ...value, usedAt: undefined } : value }
    }
    for (const [key, stored] of this.grants) {
      if (stored.expiresAt * 1000 <= now) continue
      const rotated = stored.lastRotated
      const before = rotated !== undefined && unsaved.has(rotated)
      yield {
        set: 'grant',
        key,
        value: before ? { ...stored.toGrant(), lastRotated: unsaved.get(rotated) } : stored.toGrant(),
      }
    }
    for (const [key, revoked] of this.revokedGrants)
      if (revoked.expiresAt * 1000 > now) yield { delete: 'grant', key, until: revoked.expiresAt * 1000 }
    // a refresh token used before any retry could come is kept only to be known if it is used
    // again: its scope and resources are never read, and may be long (a client's 8 KiB of them)
    const retriesOver = toSeconds(now) - MAX_REFRESH_GRACE_SECONDS - 1
    for (const [key, stored] of this.tokens) {
      if (stored.expiresAt * 1000 <= now || this.#grantGone(stored)) continue
      const token = stored.toToken()
      if (unsaved.has(key)) token.usedAt = undefined
      else if (stored.kind === 'refresh' && stored.usedAt !== undefined && stored.usedAt < retriesOver) {
        token.scope = []
        token.resource = []
      }
      yield { set: 'token', key, value: token }
    }
    for (const [key, value] of this.sessions) if (value.expiresAt > now) yield { set: 'session', key, value }
    for (const [key, value] of this.passkeys) yield { set: 'passkey', key, value }
  }

  #sweepBudget(): number {
    return Math.min(MAX_SWEEP_BUDGET, Math.max(MIN_SWEEP_BUDGET, 2 * this.#savedSinceSweep))
  }

  #putGrant(id: string, grant: Grant, lastRotated = grant.lastRotated): void {
    if (this.revokedGrants.has(id)) return // revoked while the request that saves it was under way
    this.#savedSinceSweep++
    this.grants.set(id, new StoredGrant(grant, this.#shareApp(grant), lastRotated))
  }

  #putToken(hash: string, token: Token): void {
    this.#savedSinceSweep++
    this.tokens.set(hash, new StoredToken(token, this.#shareScope(token.scope), this.#shareResource(token.resource)))
  }

  // One copy of each value that many grants and tokens hold: a million grants of a few apps
  // then hold a few copies. Values are never changed once stored. The one shared last is
  // compared first, field by field: most saves repeat it, and that spares making a key.

  #shareApp({ client_id, client_name, me, scope, resource, accessTokenTtlSeconds }: Grant): GrantedApp {
    const last = this.#lastApp
    if (
      last !== undefined &&
      last.client_id === client_id &&
      last.client_name === client_name &&
      last.me === me &&
      sameList(last.scope, scope) &&
      sameList(last.resource, resource) &&
      last.accessTokenTtlSeconds === accessTokenTtlSeconds
    )
      return last
    // Neither URLs nor scopes hold a space or a line break, so only the name, last, could: the key is unambiguous.
    const name = client_name === undefined ? '-' : `+${client_name}`
    const key = `app ${client_id}\n${me}\n${scope.join(' ')}\n${resource.join(' ')}\n${accessTokenTtlSeconds}\n${name}`
    return (this.#lastApp = this.#share(key, () => ({
      client_id,
      client_name,
      me,
      scope: this.#shareScope(scope),
      resource: this.#shareResource(resource),
      accessTokenTtlSeconds,
    })))
  }

  #shareScope(scope: string[]): string[] {
    if (this.#lastScope !== undefined && sameList(this.#lastScope, scope)) return this.#lastScope
    return (this.#lastScope = this.#share(`scope ${scope.join(' ')}`, () => scope))
  }

  #shareResource(resource: string[]): string[] {
    if (resource.length === 0) return NO_RESOURCES
    if (this.#lastResource !== undefined && sameList(this.#lastResource, resource)) return this.#lastResource
    return (this.#lastResource = this.#share(`resource ${resource.join(' ')}`, () => resource))
  }

  #share<T extends string[] | GrantedApp>(key: string, make: () => T): T {
    const shared = this.#shared.get(key)
    if (shared !== undefined) return shared as T
    if (this.#shared.size >= 1_000) this.#shared.clear()
    const value = make()
    this.#shared.set(key, value)
    return value
  }

  /** Drops the oldest entry of a capped map so that one more fits. */
  #makeRoom(map: Map<string, unknown>, max: number, what: string): void {
    if (map.size < max) return
    map.delete(map.keys().next().value ?? '')
    this.#countDrop(max, what)
  }

  #countDrop(max: number, what: string): void {
    const count = (this.#dropped.get(what) ?? 0) + 1 // counted by kind: a dropped code is not one of many requests
    this.#dropped.set(what, count)
    if (count % 1000 === 1) this.#log(`store: the cap of ${max} ${what} was reached; dropped one (${count} so far)`)
  }
}

/** The audience of every IndieAuth token: none. */
const NO_RESOURCES: string[] = []

/** The least a sweep walks of each kind: every 100 ms, 20,000 entries a second. */
const MIN_SWEEP_BUDGET = 2_000
/** The most: 60,000 entries a second, half as many again as the tokens Latch's fastest exchanges save. */
const MAX_SWEEP_BUDGET = 6_000

/** Deletes up to `budget` expired entries from a map whose insertion order is its expiry order. */
function sweepOldest(map: Map<string, { expiresAt: number }>, now: number, budget: number): void {
  let swept = 0
  for (const [key, entry] of map) {
    if (entry.expiresAt > now || swept++ === budget) return
    map.delete(key)
  }
}

function sameList(a: string[], b: string[]): boolean {
  if (a.length !== b.length) return false
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false
  return true
}

function live<T extends { expiresAt: number }>(entry: T | undefined, now: number): T | undefined {
  return entry !== undefined && entry.expiresAt > now ? entry : undefined
}

// --- Durable storage ------------------------------------------------------------
// `DATA_FILE` is an append-only journal: one JSON line per change to a code, grant, token,
// session or passkey (a token exchange's changes share one line), replayed into a `MemoryStore` at start-up.
// A change sets or deletes one entry, so replaying it twice changes nothing; that is what lets
// compaction run while writes go on. A change is on disk (fsync'd) before the response that
// depends on it is sent, and the changes made in one turn of the event loop share one fsync.
// Pending authorization requests are not kept: they live ten minutes, and a person who meets a
// restart simply starts again. One process at a time holds a journal (`holdJournal`): two
// appending to one file would each lose what the other wrote.

/** One change to one entry. */
type JournalRecord =
  | { set: 'code'; key: string; value: AuthorizationCode }
  | { set: 'grant'; key: string; value: Grant }
  | { set: 'token'; key: string; value: Token }
  | { set: 'session'; key: string; value: Session }
  | { set: 'passkey'; key: string; value: Passkey }
  | { delete: 'code' | 'grant' | 'token' | 'session' | 'passkey'; key: string; until?: number }

/**
 * A line of the journal: one change, or `{"all": [...]}`, changes that count together or not
 * at all. A crash can cut the last line short, and a cut line is dropped whole: a token
 * exchange cut short leaves its code unused, not spent without the tokens it paid for.
 */
type JournalLine = JournalRecord | { all: JournalRecord[] }

/** How long a write may wait for the disk before the log says so. */
const SLOW_DISK_SECONDS = 5

/**
 * An append-only file with group commit: `append` resolves once its lines are fsync'd. A write
 * can fail, or on a full disk write only part of what it was given without failing; either way
 * the file is cut back to where the last whole write ended, so that the next write starts on a
 * clean line, and the changes are refused. When space comes back, writes simply succeed again.
 */
class Journal {
  readonly path: string
  /** Lines in the file, as a measure of how far it has grown past the live data. */
  lines: number
  #file: FileHandle
  /** Which file `#file` is (`ino` and `dev` of its stats), to tell whether it is still the one at `path`. */
  #identity: Stats
  /** Where the last whole, fsync'd write ended. */
  #size: number
  /** Set when a failed write may have left bytes past `#size` that could not yet be cut off. */
  #torn = false
  /** Set once the file at `path` is not the one written to, nor gone: see `#checkInPlace`. */
  #replaced = false
  #queue: string[] = []
  #waiters: { resolve: () => void; reject: (err: unknown) => void }[] = []
  #scheduled = false
  #running: Promise<void> | undefined
  /**
   * While compacting: every line stored since it began, for the new file. A line joins once
   * its write succeeds: one queued or being written when the compaction began is not in the
   * snapshot yet, and one whose write failed never happened.
   */
  #sinceSnapshot: string[] | undefined
  #closed = false
  /** When the write that holds the file began, and whether the log said it is slow. */
  #holding: { since: number; said: boolean } | undefined
  readonly #log: (line: string) => void
  /** The store's clock, kept steady: a clock set back while a write waits would hide the wait. */
  readonly #now: () => number

  constructor(
    path: string,
    file: FileHandle,
    stats: Stats,
    lines: number,
    { log, now }: { log: (line: string) => void; now: () => number },
  ) {
    this.path = path
    this.#file = file
    this.#identity = stats
    this.#size = stats.size
    this.lines = lines
    this.#log = log
    this.#now = steadyClock(now)
  }

  /** The file's length in bytes, to the end of its last whole line. */
  get size(): number {
    return this.#size
  }

  /** Appends the records as one line, so that a replay finds all of them or none. */
  append(records: JournalRecord[]): Promise<void> {
    const line: JournalLine = records.length === 1 ? records[0] : { all: records }
    this.#queue.push(`${JSON.stringify(line)}\n`)
    if (!this.#scheduled) {
      this.#scheduled = true
      setImmediate(() => {
        this.#scheduled = false
        this.#kick()
      })
    }
    return new Promise((resolve, reject) => this.#waiters.push({ resolve, reject }))
  }

  /** Writes and fsyncs everything queued, unless a write or a compaction holds the file. */
  #kick(): void {
    if (this.#running !== undefined || this.#queue.length === 0) return
    const lines = this.#queue
    const waiters = this.#waiters
    this.#queue = []
    this.#waiters = []
    this.#running = this.#holdFile(() => this.#writeLines(lines)).then(
      () => {
        for (const line of lines) this.#sinceSnapshot?.push(line)
        waiters.forEach((waiter) => waiter.resolve())
      },
      (err: unknown) => {
        // a journal gone is written anew by the store, which then appends these changes again
        if (!(err instanceof JournalGone)) {
          const lost = `${countOf(lines.length, 'change')} ${lines.length === 1 ? 'was' : 'were'}`
          this.#log(`journal: writing ${this.path} failed, so ${lost} not stored: ${String(err)}${whatToDo(err)}`)
        }
        waiters.forEach((waiter) => waiter.reject(err))
      },
    )
    void this.#running.finally(() => {
      this.#running = undefined
      this.#kick()
    })
  }

  /** Writes lines whole and fsyncs them, or cuts the file back to where it was and throws. */
  async #writeLines(lines: string[]): Promise<void> {
    if (this.#replaced) throw new JournalReplaced(this.path)
    const bytes = Buffer.from(lines.join(''))
    try {
      if (this.#torn) await this.#cutBack()
      this.#checkInPlace(this.#size) // before: not one byte into a file that is not Latch's
      await writeAll(this.#file, bytes)
      await this.#file.datasync()
      this.#checkInPlace(this.#size + bytes.length) // and after, for one taken away meanwhile
    } catch (err) {
      if (err instanceof JournalReplaced) throw err // the file is someone else's now: not cut
      this.#torn = true
      await this.#cutBack().catch(() => {}) // tried again before the next write
      throw err
    }
    this.#size += bytes.length
    this.lines += lines.length
  }

  /**
   * Checks that the file written to is still the one at the journal's path, `size` bytes long.
   * What was written elsewhere would be lost at the next start, so it does not count as stored:
   * - Nothing at the path (removed, its folder too, or moved away): `JournalGone`, and the store
   *   writes the journal anew there.
   * - Another file there, or this one at another size than Latch left it (a copy put back, or
   *   written over it in place; an edit in place of the same length goes unseen):
   *   `JournalReplaced`, for good. That file is left as it is, for the next start to read, and no
   *   write is stored until then.
   */
  #checkInPlace(size: number): void {
    const there = this.#whatIsThere(size)
    if (there === 'nothing') throw new JournalGone(this.path)
    if (there === 'another') {
      this.#replaced = true
      throw new JournalReplaced(this.path)
    }
  }

  /**
   * What is at the journal's path: its file, `size` bytes long (any size when undefined); nothing;
   * or another file, or this one at another size. Synchronous: one call to the kernel, for a path it has
   * cached, costs less than a trip through libuv's thread pool (`npm run bench`, durability).
   */
  #whatIsThere(size: number | undefined): 'this file' | 'nothing' | 'another' {
    let there: Stats
    try {
      there = statSync(this.path)
    } catch {
      return 'nothing'
    }
    const same = there.ino === this.#identity.ino && there.dev === this.#identity.dev
    return same && (size === undefined || there.size === size) ? 'this file' : 'another'
  }

  /** Cuts off whatever a failed write left past the last whole line, and makes the cut durable. */
  async #cutBack(): Promise<void> {
    await this.#file.truncate(this.#size)
    await this.#file.datasync()
    this.#torn = false
  }

  /**
   * Rewrites the file as a snapshot of `live` plus what was appended meanwhile: a temporary
   * file, written whole and fsync'd, renamed over the journal, then the directory fsync'd. A
   * snapshot that could not be written whole never replaces the journal. The snapshot is
   * written in slices, so requests go on being served; none of their writes is lost.
   */
  async compact(live: () => Iterable<JournalRecord>): Promise<void> {
    if (this.#replaced) throw new JournalReplaced(this.path) // not written over
    this.#sinceSnapshot = []
    // a name of its own each time, made anew: in a folder such as /tmp, another user may have
    // made a file of any name that can be guessed, to be written into or to stand in the way
    const temporary = `${this.path}.compacting-${randomBytes(6).toString('hex')}`
    let out: FileHandle | undefined
    let next: FileHandle | undefined
    try {
      await makeFolders(dirname(this.path), 0o700) // removed while Latch ran, with the journal in it
      const snapshot = await open(temporary, 'wx', 0o600)
      out = snapshot
      let slice: string[] = [JOURNAL_HEADER]
      let lines = 0
      let size = 0
      const write = async (text: string) => {
        const bytes = Buffer.from(text)
        await writeAll(snapshot, bytes)
        size += bytes.length
      }
      for (const record of live()) {
        slice.push(`${JSON.stringify(record)}\n`)
        if (slice.length === 2_000) {
          await write(slice.join(''))
          lines += slice.length
          slice = []
          await new Promise((resolve) => setImmediate(resolve))
        }
      }
      await this.#exclusive(async () => {
        if (this.#closed) throw new Error('the journal was closed while compacting')
        const meanwhile = this.#sinceSnapshot ?? []
        await write(slice.join('') + meanwhile.join(''))
        await snapshot.datasync()
        next = await open(temporary, 'a', 0o600) // the journal's handle from now on: the same file, once renamed
        const identity = await next.stat()
        // a file put back meanwhile is not written over (nothing there: the journal is written anew)
        if (this.#replaced || this.#whatIsThere(this.#torn ? undefined : this.#size) === 'another') {
          this.#replaced = true
          throw new JournalReplaced(this.path)
        }
        await rename(temporary, this.path)
        const previous = this.#file
        this.#file = next
        this.#identity = identity
        this.#size = size
        this.#torn = false
        this.lines = lines + slice.length + meanwhile.length
        await previous.close().catch(() => {})
        await syncDirectory(dirname(this.path))
      })
    } catch (err) {
      if (next !== undefined && this.#file !== next) await next.close().catch(() => {})
      if (out !== undefined) await rm(temporary, { force: true }).catch(() => {})
      throw err
    } finally {
      await out?.close().catch(() => {})
      this.#sinceSnapshot = undefined
    }
  }

  /** Waits for the writes under way, then flushes the rest and closes the file. */
  async close(): Promise<void> {
    await this.#exclusive(async () => {
      this.#closed = true
      if (this.#queue.length > 0) {
        const lines = this.#queue
        const waiters = this.#waiters.splice(0)
        this.#queue = []
        await this.#writeLines(lines).then(
          () => waiters.forEach((waiter) => waiter.resolve()),
          (err: unknown) => waiters.forEach((waiter) => waiter.reject(err)),
        )
      }
      await this.#file.close()
    })
  }

  /**
   * Runs a write, or a compaction's last step, as the one task that holds the file: the writes
   * queued meanwhile, and the requests that made them, wait for it. On a disk that stalls that
   * may be long, and nothing else would tell the owner why requests hang: see `noteWait`.
   */
  async #holdFile(task: () => Promise<void>): Promise<void> {
    const holding = { since: this.#now(), said: false }
    this.#holding = holding
    try {
      await task()
      if (holding.said) {
        const seconds = Math.round((this.#now() - holding.since) / 1000)
        this.#log(`journal: the disk answered: the write to ${this.path} was stored after ${seconds} s`)
      }
    } finally {
      this.#holding = undefined // a failure says so itself, in the line of the write that failed
    }
  }

  /**
   * Says in the log, once, that the write holding the file has waited `SLOW_DISK_SECONDS` for the
   * disk, and again when the disk answers. Called now and then by the store's sweep, so that no
   * timer runs for a write that the disk answers in a millisecond, as nearly all do.
   */
  noteWait(): void {
    const holding = this.#holding
    if (holding === undefined || holding.said || this.#now() - holding.since < SLOW_DISK_SECONDS * 1000) return
    holding.said = true
    this.#log(
      `journal: a write to ${this.path} has waited ${SLOW_DISK_SECONDS} s for the disk so far: ` +
        'every request that changes something waits for it',
    )
  }

  /** Runs `task` while nothing else writes to the file. */
  async #exclusive(task: () => Promise<void>): Promise<void> {
    while (this.#running !== undefined) await this.#running.catch(() => {})
    this.#running = this.#holdFile(task)
    try {
      await this.#running
    } finally {
      this.#running = undefined
      this.#kick()
    }
  }
}

/** The journal's file is no longer at its path: removed, or moved away, while Latch ran. */
class JournalGone extends Error {
  constructor(path: string) {
    super(`${path} was removed or moved away while Latch ran`)
  }
}

/** Another file is at the journal's path, or another hand changed it, while Latch ran. */
class JournalReplaced extends Error {
  constructor(path: string) {
    super(`${path} was replaced or changed while Latch ran, so nothing more is stored: restart Latch to read it`)
  }
}

/**
 * Writes all of `bytes`: a write may take fewer bytes than it was given without failing (on a
 * full disk, the next one fails), so it is called again for the rest.
 */
async function writeAll(file: FileHandle, bytes: Buffer): Promise<void> {
  for (let at = 0; at < bytes.length;) {
    const { bytesWritten } = await file.write(bytes, at, bytes.length - at)
    if (bytesWritten === 0) throw new Error('the disk took no more bytes')
    at += bytesWritten
  }
}

/** The refusal to start on a journal line that is not a record: `why` says what is wrong with it. */
function notARecord(path: string, line: number, why: string): ConfigError {
  return new ConfigError(
    `${path} line ${line} is not a Latch journal record (${why}): if a newer Latch wrote it, start that ` +
      'one again: nothing is lost. Else correct that line, restore the file from a backup, or move it away ' +
      'to start empty',
  )
}

const NOT_JSON = 'it is not JSON'

/**
 * Whether the bytes after a journal's last newline can be a write that a crash cut short: the
 * start of a line as Latch writes them (`{"`, or its first byte alone), or zeros, which some file
 * systems leave where data a power cut kept from the disk was to go.
 */
function isTornLine(tail: Buffer): boolean {
  return '{"'.startsWith(tail.toString('latin1', 0, 2)) || tail.every((byte) => byte === 0)
}

/**
 * Why a journal is not safe to use, if it is not: whoever can write it can write a token into it,
 * and whoever can write a folder on its path can put another file (or folder) in its place. So
 * the file must belong to the user Latch runs as, and every folder above it, and above the link
 * that names it if `DATA_FILE` is one, must belong to that user or to root. The file may be
 * written by its owner alone: Latch makes it 0600, and a POSIX ACL that lets others write shows
 * as group write (its mask). No folder may be writable by other users, but for the sticky bit
 * (as /tmp has), which keeps others from renaming or deleting what is not theirs, and for the
 * user's own group: a user's private group, which many systems give each user with a umask of
 * 002. A folder's ACL is not read. This is what sshd asks of `~/.ssh`.
 * Without Unix users (no `geteuid`), there is nothing to check.
 */
async function unsafeDataFile(dataFile: string, path: string, file: Stats): Promise<string | undefined> {
  const uid = process.geteuid?.()
  const gid = process.getegid?.()
  if (uid === undefined) return undefined
  const othersWrite = (stats: Stats) => (stats.mode & 0o002) !== 0 || ((stats.mode & 0o020) !== 0 && stats.gid !== gid)
  if (file.uid !== uid)
    return (
      `belongs to another user (uid ${file.uid}), who could write tokens into it: ` +
      `run Latch as that user, or give the file to this one (uid ${uid}) with chown`
    )
  if ((file.mode & 0o022) !== 0)
    return `can be written by other users (${modeOf(file)}), who could write tokens into it: run chmod 600 ${path}`
  for (const folder of new Set([...foldersAbove(path), ...foldersAbove(resolve(dataFile))])) {
    const stats = await stat(folder)
    if (stats.uid !== uid && stats.uid !== 0)
      return (
        `has on its path a folder of another user (${folder}, uid ${stats.uid}), ` +
        'who could put another file in its place: choose a folder of your own'
      )
    if (othersWrite(stats) && (stats.mode & 0o1000) === 0)
      return (
        `has on its path a folder other users can write to (${folder}, ${modeOf(stats)}), ` +
        `who could put another file in its place: run chmod go-w ${folder}, or choose another folder`
      )
  }
  return undefined
}

/** A file's permissions as `ls -l` and chmod write them in octal: `mode 0600`. */
function modeOf(stats: Stats): string {
  return `mode ${(stats.mode & 0o7777).toString(8).padStart(4, '0')}`
}

/**
 * The first symbolic link on the way to a path, the file or a folder, that belongs to another
 * user than this one or root, and who owns it; undefined when there is none. A link another user
 * made in a folder such as /tmp, they may replace with one pointing anywhere: it could lead Latch
 * to make or use a file of their choosing. (The kernel's fs.protected_symlinks, which not every
 * system sets, refuses such links in sticky folders only.) Each name is looked at as the kernel
 * meets it, a link's target in its place. A name that does not exist is a folder Latch will make,
 * and the walk goes on past it, so that a `..` after it meets what the kernel will; one that
 * cannot be looked at otherwise stops Latch (see `unchecked`).
 */
async function foreignLink(path: string, uid: number): Promise<{ link: string; owner: number } | undefined> {
  const names = path.split('/')
  let at = isAbsolute(path) ? '/' : process.cwd() // a real path, as / is: `..` from it is its parent
  let links = 0
  while (names.length > 0) {
    const name = names.shift() as string
    if (name === '' || name === '.') continue
    if (name === '..') {
      at = dirname(at)
      continue
    }
    const next = join(at, name)
    const stats = await lstat(next).catch((err: NodeJS.ErrnoException) => {
      // made by Latch; or refused by open too, which then says why: a name longer than any file
      // system takes, or a folder this user may not enter
      if (err.code === 'ENOENT' || err.code === 'ENOTDIR' || err.code === 'EACCES') return undefined
      if (err.code === 'ENAMETOOLONG' && Buffer.byteLength(name) > MAX_NAME_BYTES) return undefined
      throw unchecked(path, next, err)
    })
    if (stats === undefined || !stats.isSymbolicLink()) {
      at = next
      continue
    }
    if (stats.uid !== uid && stats.uid !== 0) return { link: next, owner: stats.uid }
    if (++links > 40) return undefined // a loop, which open reports as ELOOP
    const target = await readlink(next).catch((err: NodeJS.ErrnoException) =>
      Promise.reject(unchecked(path, next, err)),
    )
    names.unshift(...target.split('/')) // followed from the link's folder, or from / when absolute
    if (isAbsolute(target)) at = '/'
  }
  return undefined
}

/** The longest name of a file or folder Linux's file systems take, in bytes. */
const MAX_NAME_BYTES = 255

/**
 * A name on the way to the data file that could not be looked at (ENAMETOOLONG, for a path that
 * links made longer than the kernel takes at once, though it follows them one by one): Latch
 * would then open it unchecked, so it refuses to start.
 */
function unchecked(dataFile: string, name: string, err: NodeJS.ErrnoException): ConfigError {
  const fix = err.code === 'ENAMETOOLONG' ? ': choose a shorter path, without links' : ''
  return new ConfigError(
    `DATA_FILE ${dataFile} could not be checked for links of other users: ${name.slice(0, 200)}` +
      `${name.length > 200 ? '…' : ''} cannot be looked at (${err.code})${fix}`,
  )
}

/**
 * Removes the snapshots that a process stopped mid-compaction left beside the journal: this
 * user's only, since in a folder such as /tmp another user's file may bear such a name too.
 */
async function removeLeftSnapshots(path: string): Promise<void> {
  const uid = process.geteuid?.()
  for (const name of await readdir(dirname(path))) {
    if (!name.startsWith(`${basename(path)}.compacting`)) continue
    const left = join(dirname(path), name)
    const stats = await lstat(left).catch(() => undefined)
    if (stats?.isFile() && (uid === undefined || stats.uid === uid)) await rm(left, { force: true })
  }
}

/** The folders a path is in, from its own up to the root. */
function foldersAbove(path: string): string[] {
  const folders = [dirname(path)]
  while (dirname(folders[folders.length - 1]) !== folders[folders.length - 1])
    folders.push(dirname(folders[folders.length - 1]))
  return folders
}

/**
 * Holds a journal for this process, before it is read: two processes appending to one journal
 * would each lose the other's changes, as a compaction renames a new file over the one the other
 * appends to. The hold is a socket listening in Linux's abstract namespace under a name made from
 * the file's real path: binding it is atomic, so of two servers started at once one wins, and the
 * kernel lets go of it when the process ends, however it ends, so nothing is left to clean up.
 * The holder answers a connection with its process id, for the other's message. Any local user
 * may bind such a name, so a holder counts only if that process has the file open, which only
 * its owner can see: a name taken by a stranger is passed over with a warning, not obeyed. A
 * holder that does not answer within a second (reading a long journal) is found as the process
 * that bound the name, and counts if it has the file open. A second store on a journal this
 * process holds already is refused too: two stores in one process, each with its own memory,
 * lose each other's changes the same way. Elsewhere than Linux, and between containers that do
 * not share a network namespace, nothing is held.
 */
async function holdJournal(path: string, log: (line: string) => void): Promise<string | undefined> {
  if (process.platform !== 'linux') return undefined
  const name = `\0latch-journal-${hash('sha256', path, 'base64url')}`
  if (heldJournals.has(name))
    throw new ConfigError(`DATA_FILE ${path} is open already in this process: close that store first, or use it`)
  const server = createNetServer((socket) => {
    socket.on('error', () => {}) // a caller that hung up at once: nothing to tell it, and no reason to stop
    socket.end(`${process.pid}\n`)
  })
  const bound = await new Promise<NodeJS.ErrnoException | undefined>((resolve) => {
    server.once('error', resolve)
    server.listen({ path: name }, () => resolve(undefined))
  })
  if (bound?.code === 'EADDRINUSE') {
    // a holder too busy to answer (reading a long journal) is found through its socket instead
    const answered = await askHolder(name)
    const holder = answered !== undefined && (await hasOpen(answered, path)) ? answered : await findHolder(name, path)
    if (holder !== undefined)
      throw new ConfigError(
        `DATA_FILE ${path} is in use by process ${holder}: stop that server, or give this one another DATA_FILE`,
      )
    log(`warning: a process that does not have ${path} open holds its name; opening it without a hold`)
    return undefined
  }
  if (bound !== undefined) return undefined // no socket to hold it with here: go on, as elsewhere than Linux
  server.unref()
  heldJournals.set(name, server)
  return name
}

/** The journals this process holds, by the name of the socket that holds each. */
const heldJournals = new Map<string, NetServer>()

function releaseJournal(name: string | undefined): void {
  if (name === undefined) return
  heldJournals.get(name)?.close()
  heldJournals.delete(name)
}

/**
 * The process that bound a hold's name, if it has the journal open: a holder too busy to answer.
 * The kernel lists the name's socket in /proc/net/unix with its inode, and the process holding
 * it has a descriptor that reads `socket:[inode]`. Only this user's processes (every one, for
 * root) can be looked into, which is all a real holder can be: the journal is this user's.
 */
async function findHolder(name: string, path: string): Promise<string | undefined> {
  // an abstract name is listed with @ for each 0 byte: its first, and those node pads it with
  const listed = ` @${name.slice(1)}`
  const table = await readFile('/proc/net/unix', 'latin1').catch(() => '')
  const sockets = new Set(
    table
      .split('\n')
      .filter((line) => line.replace(/@+$/, '').endsWith(listed))
      .map((line) => `socket:[${line.trim().split(/\s+/)[6]}]`),
  )
  if (sockets.size === 0) return undefined
  const pids = (await readdir('/proc').catch(() => [])).filter((pid) => /^\d+$/.test(pid) && pid !== `${process.pid}`)
  const holding = await Promise.all(
    pids.map(async (pid) => {
      for (const fd of await readdir(`/proc/${pid}/fd`).catch(() => []))
        if (sockets.has(await readlink(`/proc/${pid}/fd/${fd}`).catch(() => ''))) return pid
      return undefined
    }),
  )
  const holder = holding.find((pid) => pid !== undefined)
  return holder !== undefined && (await hasOpen(holder, path)) ? holder : undefined
}

/** Whether a process has the file open: readable only for its owner's processes (and root's). */
async function hasOpen(pid: string, path: string): Promise<boolean> {
  const fds = await readdir(`/proc/${pid}/fd`).catch(() => [])
  for (const fd of fds) if ((await readlink(`/proc/${pid}/fd/${fd}`).catch(() => '')) === path) return true
  return false
}

/**
 * The process id that the holder of a journal answers with, or undefined after a second. A
 * holder reading a long journal answers too: the reading pauses for the event loop.
 */
function askHolder(name: string): Promise<string | undefined> {
  return new Promise((resolve) => {
    let text = ''
    const socket = connect({ path: name })
    socket.setEncoding('utf8')
    socket.setTimeout(1_000, () => socket.destroy())
    socket.on('data', (chunk: string) => (text += chunk).length > 20 && socket.destroy())
    socket.on('error', () => {})
    socket.on('close', () => resolve(/^\d+\n$/.test(text) ? text.trim() : undefined))
  })
}

async function syncDirectory(path: string): Promise<void> {
  const directory = await open(path, 'r')
  try {
    await directory.sync()
  } finally {
    await directory.close()
  }
}

/** Options of the file store. */
export type FileStoreOptions = MemoryStoreOptions & {
  /** The clock used while replaying and compacting; defaults to `Date.now`. */
  now?: () => number
}

/**
 * The durable `Store`: a `MemoryStore` that serves every read, behind a journal that every
 * change is written to before it takes effect. A single-use mark (a code or refresh token
 * taken) is set in memory first, so that two requests cannot both take it, and taken back if
 * it cannot be stored. Open it with `FileStore.open(path)`.
 */
export class FileStore implements Store {
  readonly memory: MemoryStore
  /** The compaction under way, if any. */
  compaction: Promise<void> | undefined
  /**
   * Codes and refresh tokens marked used whose write is under way, each with the token its grant
   * rotated last before (see `MemoryStore.records`).
   */
  readonly #unsaved = new Map<string, string | undefined>()
  /** The writes of those marks, for a retry of the same refresh token to wait on (see `#redeemAndStore`). */
  readonly #firstWrites = new Map<string, Promise<void>>()
  /** Removals of grants and tokens being written, for a repeat to wait on (see `#removeOnce`). */
  readonly #removing = new Map<string, Promise<void>>()
  /** After a failed compaction, how long the journal must grow before the next try; 0 once one succeeds. */
  #compactAfterLines = 0
  /** The journal's size after its last compaction: 0 before the first in this process. */
  #snapshotBytes = 0
  readonly #journal: Journal
  readonly #hold: string | undefined
  readonly #now: () => number
  readonly #log: (line: string) => void

  private constructor(memory: MemoryStore, journal: Journal, hold: string | undefined, options: FileStoreOptions) {
    this.memory = memory
    this.#journal = journal
    this.#hold = hold
    this.#now = options.now ?? Date.now
    this.#log = neverThrowing(options.log ?? console.log)
  }

  /**
   * Opens (or creates, with mode 0600) a data file and replays it. A torn last line, left by a
   * crash mid-write, is dropped with a warning (a last line whole but for its newline is kept);
   * any other unreadable line stops with its number.
   * The file is this process's alone until `close` (see `holdJournal`). A symlink is followed
   * to its file, which compaction then replaces, not the link; one of another user than this one
   * or root, on the way to the file, is refused (see `foreignLink`).
   */
  static async open(dataFile: string, options: FileStoreOptions = {}): Promise<FileStore> {
    const log = neverThrowing(options.log ?? console.log)
    const memory = new MemoryStore(options)
    // before anything is made: a planted link would have it made where its owner chose
    const uid = process.geteuid?.()
    const planted = uid === undefined ? undefined : await foreignLink(dataFile, uid)
    if (planted !== undefined)
      throw new ConfigError(
        `DATA_FILE ${dataFile} has on its path a symbolic link of another user (${planted.link}, ` +
          `uid ${planted.owner}), who could replace it with one pointing anywhere: ` +
          'remove the link, or choose a path without it',
      )
    await makeFolders(dirname(dataFile), 0o700)
    const found = await stat(dataFile).catch((err: NodeJS.ErrnoException) =>
      err.code === 'ENOENT' ? undefined : Promise.reject(err),
    )
    // a directory goes on to open's EISDIR, which `dataFileProblem` explains; a pipe would never open
    if (found !== undefined && !found.isFile() && !found.isDirectory())
      throw new ConfigError(`DATA_FILE ${dataFile} is not a file: name a file, or a path where one can be made`)
    const file = await open(dataFile, 'a', 0o600) // made now if need be, through a symlink too
    let hold: string | undefined
    try {
      const path = await realpath(dataFile) // compaction replaces the file a symlink points to, not the link
      // compaction writes the new journal beside the old one: a folder it cannot write would let
      // the journal grow without end
      const refusal =
        (await unsafeDataFile(dataFile, path, await file.stat())) ??
        (await access(dirname(path), fsConstants.R_OK | fsConstants.W_OK | fsConstants.X_OK).then(
          () => undefined,
          () =>
            ownFolderModeProblem(path) ??
            `is in a folder this user cannot write (${dirname(path)}), where the journal is rewritten as it ` +
              'grows: give the user the folder, or choose a path in one it owns',
        ))
      if (refusal !== undefined) {
        if (found === undefined) await rm(path, { force: true }) // made just now: nothing is left of a refused start
        throw new ConfigError(`DATA_FILE ${path} ${refusal}`)
      }
      hold = await holdJournal(path, log)
      await removeLeftSnapshots(path)
      const bytes = await readFile(path)
      // Lines are cut at newline bytes and decoded one by one: a file may hold more than a
      // string can, and a stray byte that is not UTF-8 must not move the cut below.
      const end = bytes.lastIndexOf(0x0a) + 1 // after it: a write cut short, or a last line lacking only its newline
      const now = (options.now ?? Date.now)()
      let newest = 0 // when the latest entry was made, to tell a clock set behind it
      const apply = async (records: JournalRecord[]) => {
        for (const record of records) {
          newest = Math.max(newest, madeAt(record))
          await applyRecord(memory, record, now)
        }
      }
      let lines = 0
      // an editor's byte order mark, and blank lines, are no one's records: passed over
      const bom = bytes[0] === 0xef && bytes[1] === 0xbb && bytes[2] === 0xbf ? 3 : 0
      let formatted = bytes.toString('utf8', bom, bom + JOURNAL_HEADER.length) === JOURNAL_HEADER
      for (let start = bom; start < end; lines++) {
        const stop = bytes.indexOf(0x0a, start)
        const text = stop - start > MAX_JOURNAL_LINE_BYTES ? undefined : bytes.toString('utf8', start, stop)
        const records =
          text === undefined
            ? `it is longer than ${MAX_JOURNAL_LINE_BYTES / 2 ** 20} MiB, which no record is`
            : /^\s*$/.test(text)
              ? []
              : readJournalLine(text)
        if (typeof records === 'string') throw notARecord(path, lines + 1, records)
        await apply(records)
        start = stop + 1
        // a server started meanwhile asks who holds the journal: the answer must not wait for the end
        if (lines % 10_000 === 9_999) await new Promise((resolve) => setImmediate(resolve))
      }
      const tail = bytes.subarray(Math.max(end, bom))
      const tailText = tail.length === 0 || tail.length > MAX_JOURNAL_LINE_BYTES ? '' : tail.toString('utf8')
      const whole = tailText === '' ? '' : /^\s*$/.test(tailText) ? [] : readJournalLine(tailText)
      if (typeof whole !== 'string') {
        // a whole line but for its newline, which a hand edit or a copy can drop: kept, since it
        // may be a revocation, and ended, so that the next write starts a line of its own
        await apply(whole)
        lines++
        await writeAll(file, Buffer.from('\n'))
        await file.datasync()
      } else if (tail.length > 0) {
        // JSON that closes is no write cut short: a record with a field wrong, refused as on any line
        if (whole !== '' && whole !== NOT_JSON) throw notARecord(path, lines + 1, whole)
        if (!isTornLine(tail))
          throw new ConfigError(
            `${path} does not end as a Latch journal does: ` +
              'restore the file from a backup, or move it away to start empty',
          )
        const dropped = bytes.length - end // a byte order mark before a first line cut short goes with it
        const size = dropped === 1 ? '1 byte' : `${dropped.toLocaleString('en-US')} bytes`
        log(`warning: ${path} ends with an incomplete line (${size}), as a crash mid-write leaves it; dropping it`)
        await truncate(path, end)
      }
      if (newest > now + CLOCK_BEHIND_MS)
        log(
          `warning: the clock says ${new Date(now).toISOString()}, before the newest entry in ${path} ` +
            `(${new Date(newest).toISOString()}): it is behind. Until it is set right, what Latch issues ends ` +
            'when it is, and what expired meanwhile counts as live: start Latch once the clock is synced. ' +
            'If it is right, that entry was written while it was ahead, and this is said at each start until ' +
            "the clock passes that entry's time",
        )
      if ((await file.stat()).size === 0) {
        // a new journal (or one left empty) begins with its format; on a full disk, its first compaction writes it
        try {
          await writeAll(file, Buffer.from(JOURNAL_HEADER))
          await file.datasync()
          lines++
          formatted = true
        } catch {
          await file.truncate(0).catch(() => {})
        }
      }
      await syncDirectory(dirname(path))
      const stats = await file.stat()
      const store = new FileStore(
        memory,
        new Journal(path, file, stats, lines, { log, now: options.now ?? Date.now }),
        hold,
        options,
      )
      if (stats.size > 0 && !formatted) {
        // an older Latch wrote it, which could start on it still: rewritten now, it begins with its
        // format, and none will (a full disk leaves it to the next compaction, as any)
        log(`journal: ${path} has no line naming its format: writing it anew with one, which no older Latch reads`)
        store.#compact()
      }
      return store
    } catch (err) {
      releaseJournal(hold)
      await file.close()
      throw err
    }
  }

  savePending(id: string, request: PendingRequest, now: number): Promise<void> {
    return this.memory.savePending(id, request, now)
  }

  findPending(id: string, now: number): Promise<PendingRequest | undefined> {
    return this.memory.findPending(id, now)
  }

  takePending(id: string, now: number): Promise<PendingRequest | undefined> {
    return this.memory.takePending(id, now)
  }

  async saveCode(hash: string, code: AuthorizationCode, now: number): Promise<void> {
    await this.#append([{ set: 'code', key: hash, value: code }])
    await this.memory.saveCode(hash, code, now)
  }

  findCodeUsedOrNot(hash: string, now: number): Promise<AuthorizationCode | undefined> {
    return this.memory.findCodeUsedOrNot(hash, now)
  }

  async markCodeUsed(hash: string, now: number): Promise<boolean> {
    const redeemed = { kind: 'code', hash } as const
    return (await this.#redeemAndStore(redeemed, now, () => [])) !== undefined
  }

  /** The code or refresh token taken, the grant and its new tokens: one line of the journal, and so one fsync. */
  async redeemForTokens(issue: TokenIssue, now: number): Promise<boolean> {
    const { redeemed, grantId, grant, tokens } = issue
    const records = () => {
      // rotated last as `redeem` has just left it in memory: a retry moves it in neither
      if (redeemed.kind === 'refresh') grant.lastRotated = this.memory.grants.get(grantId)?.lastRotated
      const records: JournalRecord[] = [{ set: 'grant', key: grantId, value: grant }]
      for (const [key, value] of tokens) records.push({ set: 'token', key, value })
      return records
    }
    const redemption = await this.#redeemAndStore(redeemed, now, records)
    if (redemption === undefined) return false
    this.memory.keepIssued(issue, redemption)
    return true
  }

  /**
   * Marks a code or refresh token used in memory at once, so that a second caller loses, then
   * writes that with the `records` made once it is marked, as one line. A write that fails takes
   * the mark back. Says how it was redeemed (`MemoryStore.redeem`), or undefined when it was not.
   */
  async #redeemAndStore(
    redeemed: TokenIssue['redeemed'],
    now: number,
    records: () => JournalRecord[],
  ): Promise<'first' | 'again' | undefined> {
    const rotatedBefore = this.memory.rotatedLastBefore(redeemed)
    const redemption = this.memory.redeem(redeemed, now)
    if (redemption === undefined) return undefined
    if (redemption === 'again') {
      // a retry rests on the first redemption: if that is taken back, as its write failed, so is
      // this one, else the token, unused again, would have its tokens out and no reuse ever seen
      await this.#firstWrites.get(redeemed.hash)
      return this.#append(records()).then(() => redemption)
    }
    this.#unsaved.set(redeemed.hash, rotatedBefore)
    const written = this.#append([this.#redeemedRecord(redeemed), ...records()]).then(() => {
      // the rotation's answer leaves only now: a retry's grace counts from here (see `findToken`)
      const stored = redeemed.kind === 'refresh' ? this.memory.tokens.get(redeemed.hash) : undefined
      if (stored?.usedAt !== undefined) stored.usedAt = Math.max(stored.usedAt, toSeconds(this.#now()))
    })
    this.#firstWrites.set(redeemed.hash, written)
    try {
      await written
    } catch (err) {
      this.memory.unredeem(redeemed, rotatedBefore)
      throw err
    } finally {
      this.#unsaved.delete(redeemed.hash)
      this.#firstWrites.delete(redeemed.hash)
    }
    return redemption
  }

  /** The record of a code or refresh token just marked used, as the memory now holds it. */
  #redeemedRecord({ kind, hash }: TokenIssue['redeemed']): JournalRecord {
    if (kind === 'code') return { set: 'code', key: hash, value: this.memory.codes.get(hash) as AuthorizationCode }
    return { set: 'token', key: hash, value: (this.memory.tokens.get(hash) as StoredToken).toToken() }
  }

  async saveGrant(id: string, grant: Grant, now: number): Promise<void> {
    await this.#append([{ set: 'grant', key: id, value: grant }])
    await this.memory.saveGrant(id, grant, now)
  }

  findGrant(id: string, now: number): Promise<Grant | undefined> {
    return this.memory.findGrant(id, now)
  }

  listGrants(now: number): Promise<[string, Grant][]> {
    return this.memory.listGrants(now)
  }

  async revokeGrant(id: string, now: number): Promise<void> {
    // revoked and written already: a code replayed over and over for its minutes writes nothing more
    if (this.memory.revokedGrants.has(id) && !this.memory.grants.has(id)) return
    await this.#removeOnce({ delete: 'grant', key: id }, () => this.memory.revokeGrant(id, now))
  }

  /**
   * Writes the removal of a grant or a token once, however many ask for it while it is being
   * written: on a disk that stalls, a code replayed or a token revoked over and over would else
   * queue a line each time. Each asker is answered when that one write is done.
   */
  #removeOnce(record: { delete: 'grant' | 'token'; key: string }, apply: () => Promise<void>): Promise<void> {
    const key = `${record.delete} ${record.key}`
    let removal = this.#removing.get(key)
    if (removal === undefined) {
      removal = this.#append([record])
        .then(apply)
        .finally(() => this.#removing.delete(key))
      this.#removing.set(key, removal)
    }
    return removal
  }

  /** One line, and so one fsync, however many apps: on a full disk, nothing is revoked. */
  async revokeApprovedBy(approvedBy: number, now: number): Promise<number> {
    const { records, apps } = this.memory.approvedBy(approvedBy, now)
    if (records.length === 0) return 0
    await this.#append(records)
    for (const record of records) await applyRecord(this.memory, record, now)
    return apps
  }

  /** Last use is kept in memory only: after a restart it is the last time a token was issued. */
  touchGrant(id: string, now: number): Promise<void> {
    return this.memory.touchGrant(id, now)
  }

  async saveToken(hash: string, token: Token, now: number): Promise<void> {
    await this.#append([{ set: 'token', key: hash, value: token }])
    await this.memory.saveToken(hash, token, now)
  }

  /**
   * A refresh token whose rotation is being written is read once it is written: sent again
   * meanwhile, it is a retry whose answer has not even left, and a disk that stalls for longer
   * than `REFRESH_TOKEN_GRACE` must not make it a reuse. So the grace counts from the write
   * (`#redeemAndStore`); after a restart, from the rotation's time as the journal kept it.
   */
  findToken(hash: string, now: number): Promise<Token | undefined> {
    const writing = this.#firstWrites.get(hash)
    const read = () => this.memory.findToken(hash, now)
    return writing === undefined ? read() : writing.then(read, read) // a write that failed took its mark back
  }

  deleteToken(hash: string): Promise<void> {
    return this.#removeOnce({ delete: 'token', key: hash }, () => this.memory.deleteToken(hash))
  }

  async saveSession(hash: string, session: Session, now: number): Promise<void> {
    await this.#append([{ set: 'session', key: hash, value: session }])
    await this.memory.saveSession(hash, session, now)
  }

  findSession(hash: string, now: number): Promise<Session | undefined> {
    return this.memory.findSession(hash, now)
  }

  /** Deletes a session; one it does not hold, as a browser's stale cookie names, costs no line. */
  async deleteSession(hash: string): Promise<void> {
    if (!this.memory.sessions.has(hash)) return
    await this.#append([{ delete: 'session', key: hash }])
    await this.memory.deleteSession(hash)
  }

  /** Deletes the sessions there are now: one whose save is still being written is not among them, on disk or here. */
  async deleteAllSessions(): Promise<void> {
    const keys = [...this.memory.sessions.keys()]
    if (keys.length === 0) return
    await this.#append(keys.map((key) => ({ delete: 'session', key })))
    for (const key of keys) await this.memory.deleteSession(key)
  }

  async savePasskey(id: string, passkey: Passkey, now: number): Promise<void> {
    await this.#append([{ set: 'passkey', key: id, value: passkey }])
    await this.memory.savePasskey(id, passkey, now)
  }

  findPasskey(id: string): Promise<Passkey | undefined> {
    return this.memory.findPasskey(id)
  }

  listPasskeys(): Promise<[string, Passkey][]> {
    return this.memory.listPasskeys()
  }

  async deletePasskey(id: string): Promise<void> {
    await this.#append([{ delete: 'passkey', key: id }])
    await this.memory.deletePasskey(id)
  }

  /** Sweeps the memory, and says in the log when a write has waited long for the disk (`Journal.noteWait`). */
  sweep(now: number, budget?: number): void {
    this.memory.sweep(now, budget)
    this.#journal.noteWait() // on the store's own clock: a handler's may be another
  }

  /** Lets a compaction under way finish, flushes what is queued and closes the file. */
  async close(): Promise<void> {
    await this.compaction
    await this.#journal.close()
    releaseJournal(this.#hold)
  }

  /**
   * Appends changes, then compacts once the file holds far more lines than live entries. A
   * journal removed or moved away while Latch ran is written anew at its path, whole, from what
   * this store holds (a compaction), and the changes are appended to it then.
   */
  async #append(records: JournalRecord[]): Promise<void> {
    try {
      await this.#journal.append(records)
    } catch (err) {
      if (!(err instanceof JournalGone)) throw new NotStored(err)
      if (this.compaction === undefined) {
        this.#log(
          `journal: ${err.message}: writing it anew from memory. A copy moved away no longer follows ` +
            'what happens (revocations included): stop Latch before moving its data file',
        )
        this.#compact()
      }
      await this.compaction
      await this.#journal.append(records).catch((again: unknown) => {
        // the journal could not be written anew: its failure is logged, and this too
        if (again instanceof JournalGone) this.#log(`journal: ${again.message}, so a change was not stored`)
        throw new NotStored(again)
      })
    }
    const lines = this.#journal.lines
    if (this.compaction !== undefined || lines <= this.#compactAfterLines) return
    // in bytes too: a refresh of a client with 8 KiB of scopes and resources writes 30 KB
    if (this.#journal.size > Math.max(COMPACT_MIN_BYTES, COMPACT_FACTOR * this.#snapshotBytes)) return this.#compact()
    // the cheap tests first: counting live entries walks the 64 shards of grants, revoked grants and tokens
    if (lines <= COMPACT_MIN_LINES) return
    // every entry a snapshot writes, the revoked grants' lines too: else, more of them than three
    // times the rest, each snapshot would be past this test already, and compact again at once
    const { codes, grants, revokedGrants, tokens, sessions, passkeys } = this.memory
    const written = codes.size + grants.size + revokedGrants.size + tokens.size + sessions.size + passkeys.size
    if (lines > COMPACT_FACTOR * written) this.#compact()
  }

  #compact(): void {
    this.compaction = this.#journal
      .compact(() => this.memory.records(this.#now(), this.#unsaved))
      .then(() => {
        this.#compactAfterLines = 0
        this.#snapshotBytes = this.#journal.size
      })
      .catch((err: unknown) => {
        // not again at every write, on a disk still full
        this.#compactAfterLines = this.#journal.lines + COMPACT_MIN_LINES
        const again = `is tried again ${COMPACT_MIN_LINES.toLocaleString('en-US')} lines on`
        const left = existsSync(this.#journal.path) ? `it stays as it was, and ${again}` : 'it is still missing'
        this.#log(`journal: compacting ${this.#journal.path} failed, so ${left}: ${String(err)}${whatToDo(err)}`)
      })
      .finally(() => (this.compaction = undefined))
  }
}

/**
 * What the owner can do about a write the disk refused, for the log line that says so. Once space
 * is freed, writes go on by themselves: a restart, the first thing one would try, is not needed.
 */
function whatToDo(err: unknown): string {
  const freed = 'writes go on by themselves once it is, with no restart'
  const fix: Record<string, string> = {
    ENOSPC: `the disk is full: free some space; ${freed}`,
    EDQUOT: `the user's disk quota is used up: free some of its space, or raise the quota; ${freed}`,
    EROFS: 'the file system is read-only, as one is made after disk errors: see the system log (dmesg)',
    EIO: 'the disk could not write: see the system log (dmesg)',
  }
  const said = fix[(err as NodeJS.ErrnoException).code ?? '']
  return said === undefined ? '' : ` (${said})`
}

const COMPACT_MIN_LINES = 10_000
/** A journal this long is compacted, whatever its lines, and then whenever it is four times its last snapshot. */
const COMPACT_MIN_BYTES = 64 * 2 ** 20
/** Far more than any line Latch writes, and far less than the longest string V8 can make of one. */
const MAX_JOURNAL_LINE_BYTES = 256 * 2 ** 20
const COMPACT_FACTOR = 4

/** Reads one journal line into its records, or says what is wrong with it. */
function readJournalLine(line: string): JournalRecord[] | string {
  let parsed: unknown
  try {
    parsed = JSON.parse(line)
  } catch {
    return NOT_JSON
  }
  if (isObject(parsed) && parsed.journal === 'latch') {
    const { format } = parsed
    if (format === JOURNAL_FORMAT) return [] // this one's own
    return Number.isInteger(format) && Number(format) > JOURNAL_FORMAT
      ? `a newer Latch wrote it, in format ${String(format)}`
      : 'its format is none Latch wrote'
  }
  const all = isObject(parsed) ? parsed.all : undefined
  const records: unknown[] = Array.isArray(all) ? all : [parsed]
  if (records.length === 0) return 'it is an empty group of changes'
  for (const record of records) {
    const problem = journalRecordProblem(record)
    if (problem !== undefined) return problem
  }
  return records as JournalRecord[]
}

/**
 * The first line of a journal: which Latch can read it. A Latch older than this line refuses it
 * (a record without a key) and stops, instead of dropping at its next write what a newer Latch
 * wrote, as some did. A Latch refuses a format newer than its own.
 * A journal written before it is compacted at the first start that reads it, and so gets it.
 */
const JOURNAL_FORMAT = 1
const JOURNAL_HEADER = `${JSON.stringify({ journal: 'latch', format: JOURNAL_FORMAT })}\n`

/** What a stored value of each kind holds, field by field: `?` marks a field that may be absent. */
const JOURNAL_FIELDS = {
  code: {
    client_id: 'string',
    client_name: 'string?',
    redirect_uri: 'string',
    code_challenge: 'string',
    scope: 'strings',
    resource: 'strings?',
    me: 'string',
    accessTokenTtlSeconds: 'number?', // see `applyRecord`
    approvedForSeconds: 'number?',
    issuedAt: 'number',
    expiresAt: 'number',
    usedAt: 'number?',
  },
  grant: {
    client_id: 'string',
    client_name: 'string?',
    me: 'string',
    scope: 'strings',
    resource: 'strings?',
    accessTokenTtlSeconds: 'number?',
    approvedAt: 'number',
    lastUsedAt: 'number',
    endsAt: 'number?',
    expiresAt: 'number',
    lastRotated: 'key?',
  },
  token: {
    kind: 'kind',
    grantId: 'key',
    scope: 'strings',
    resource: 'strings?',
    issuedAt: 'number',
    expiresAt: 'number',
    usedAt: 'number?',
  },
  session: { createdAt: 'number', expiresAt: 'number', passwordTag: 'string?' },
  passkey: {
    name: 'string',
    publicKey: 'string',
    algorithm: 'number',
    counter: 'number',
    addedAt: 'number',
    lastUsedAt: 'number?',
    userHandle: 'string?',
    rpId: 'string?',
  },
} as const

/** Why a record is not one Latch writes, or undefined when it is. */
function journalRecordProblem(record: unknown): string | undefined {
  if (!isObject(record)) return 'a change is not a JSON object'
  if (!isJournalKey(record.key)) return 'a change has no valid key'
  if (record.delete !== undefined) {
    if (!['code', 'grant', 'token', 'session', 'passkey'].includes(record.delete as string))
      return `it deletes an unknown kind ${String(record.delete)}`
    if (record.until === undefined) return undefined
    if (record.delete !== 'grant') return `a deleted ${String(record.delete)} has an until, which only a grant has`
    return Number.isFinite(record.until) ? undefined : 'a revoked grant is kept until a time that is not a number'
  }
  if (typeof record.set !== 'string' || !Object.hasOwn(JOURNAL_FIELDS, record.set))
    return 'a change neither sets nor deletes a known kind of entry'
  if (!isObject(record.value)) return `a ${record.set} has no value`
  for (const [field, kind, valid] of JOURNAL_CHECKS[record.set as keyof typeof JOURNAL_FIELDS]) {
    const value = record.value[field]
    if (!valid(value))
      return `a ${record.set}'s ${field} is ${value === undefined ? 'missing' : `not a valid ${kind.replace('?', '')}`}`
  }
  return undefined
}

type FieldKind = 'string' | 'string?' | 'number' | 'number?' | 'strings' | 'strings?' | 'key' | 'key?' | 'kind'

/** How each kind of field is checked. */
const FIELD_CHECKS: Record<FieldKind, (value: unknown) => boolean> = {
  string: (value) => typeof value === 'string',
  'string?': (value) => value === undefined || typeof value === 'string',
  number: (value) => Number.isFinite(value),
  'number?': (value) => value === undefined || Number.isFinite(value),
  strings: (value) => Array.isArray(value) && value.every((item) => typeof item === 'string'),
  'strings?': (value) =>
    value === undefined || (Array.isArray(value) && value.every((item) => typeof item === 'string')),
  key: isJournalKey,
  'key?': (value) => value === undefined || isJournalKey(value),
  kind: (value) => value === 'access' || value === 'refresh',
}

/**
 * `JOURNAL_FIELDS` as a list of checks per kind, made once: a start replays a line per entry,
 * and 100,000 live tokens should not cost a second.
 */
const JOURNAL_CHECKS = Object.fromEntries(
  Object.entries(JOURNAL_FIELDS).map(([set, fields]) => [
    set,
    Object.entries(fields).map(([field, kind]: [string, FieldKind]) => [field, kind, FIELD_CHECKS[kind]] as const),
  ]),
) as Record<keyof typeof JOURNAL_FIELDS, (readonly [string, FieldKind, (value: unknown) => boolean])[]>

/** A key: what `hashSecret` made, or a whole SHA-256 as Latch 0.1 kept it, or a store's own id. */
function isJournalKey(key: unknown): key is string {
  return typeof key === 'string' && key !== ''
}

async function applyRecord(memory: MemoryStore, record: JournalRecord, now: number): Promise<void> {
  const key = currentKey(record.key)
  if ('delete' in record) {
    if (record.delete === 'grant') await memory.revokeGrant(key, now, record.until)
    else if (record.delete === 'code') memory.codes.delete(key)
    else if (record.delete === 'token') await memory.deleteToken(key)
    else if (record.delete === 'session') await memory.deleteSession(key)
    else await memory.deletePasskey(record.key) // a credential id, not a hash
    return
  }
  if (record.set === 'passkey') return memory.savePasskey(record.key, record.value, now)
  if (record.value.expiresAt <= now) return
  // before 0.3, nothing had a resource; the value is the store's to keep, so it is completed in place
  if (record.set !== 'session' && record.value.resource === undefined) record.value.resource = []
  // in 0.1, no lifetime of a grant's own: as long as any, so that ACCESS_TOKEN_TTL as set now applies
  if ((record.set === 'code' || record.set === 'grant') && record.value.accessTokenTtlSeconds === undefined)
    record.value.accessTokenTtlSeconds = MAX_DURATION_SECONDS
  if (record.set === 'code') await memory.saveCode(key, record.value, now)
  else if (record.set === 'grant') await memory.saveGrant(key, record.value, now)
  else if (record.set === 'token') {
    record.value.grantId = currentKey(record.value.grantId)
    await memory.saveToken(key, record.value, now)
  }
  // before 0.2: ended by the check
  else await memory.saveSession(key, { ...record.value, passwordTag: record.value.passwordTag ?? '' }, now)
}

/**
 * When an entry that expires was last written: a code's issue or use, a grant's approval or last
 * refresh, a token's issue or use, a session's start; 0 for a deletion, and for a passkey: it
 * does not expire, so a clock that is off changes nothing of it.
 */
function madeAt(record: JournalRecord): number {
  if (!('set' in record)) return 0
  if (record.set === 'code') return Math.max(record.value.issuedAt, record.value.usedAt ?? 0)
  if (record.set === 'grant') return Math.max(record.value.approvedAt, record.value.lastUsedAt)
  if (record.set === 'token') return Math.max(record.value.issuedAt, record.value.usedAt ?? 0)
  return record.set === 'session' ? record.value.createdAt : 0
}

/**
 * How far behind the data file's newest entry the clock may be at start before it is said: a
 * clock synced since it was written is not; one of a box that boots without a clock of its own
 * is, until a time server sets it (a clock ahead cannot be told from time the server was off).
 */
const CLOCK_BEHIND_MS = 60_000

/** Latch 0.1 kept whole SHA-256 hashes (43 characters): a key from then is cut as `hashSecret` cuts. */
function currentKey(key: string): string {
  return key.length === 43 ? cutHash(key) : key
}

/** The store a configuration asks for: in memory, or a journal at `DATA_FILE`. */
export async function openStore(config: Config, options: FileStoreOptions = {}): Promise<MemoryStore | FileStore> {
  return config.dataFile === 'memory' ? new MemoryStore(options) : FileStore.open(config.dataFile, options)
}

// --- Performance internals ------------------------------------------------------
// What the protocol needs from this part: secrets hashed and drawn fast, and a million live
// tokens kept in little memory, expiring without stalling the server. Nothing here changes
// what Latch answers, but for whole seconds: an expiry is kept rounded up (introspection's `exp`
// may be a second past `expires_in`), and a rotation's time rounded down (the refresh grace may
// last a second longer). `npm run bench` measures what each piece saves.

const BASE64URL_ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_'

/** The 6-bit value of each base64url character, by character code. */
const BASE64URL_VALUES = new Uint8Array(128)
for (const [value, char] of [...BASE64URL_ALPHABET].entries()) BASE64URL_VALUES[char.charCodeAt(0)] = value

/** Each base64url character, by character code, with its last 4 bits zeroed. */
const TOP_TWO_BITS = Array.from({ length: 128 }, (_, code) => BASE64URL_ALPHABET[BASE64URL_VALUES[code] & 0b110000])

/**
 * The first 128 bits of a whole hash in base64url: 21 characters of 6 bits, and the first 2
 * bits of the 22nd, whose other 4 become zero (as if the bytes stopped there). Joined, not
 * added with `+`: V8 would keep that as a pair of parts still holding the whole hash.
 */
function cutHash(whole: string): string {
  return [whole.slice(0, 21), TOP_TWO_BITS[whole.charCodeAt(21) & 127]].join('')
}

/**
 * Random bytes for secrets, drawn from the system a few kilobytes at a time: one call for 32
 * bytes costs as much as one for 4 KiB, and a token exchange needs two secrets. Bytes are zeroed
 * once used, so the pool never holds a secret already handed out (Node's randomUUID keeps a
 * cache the same way).
 */
const randomPool = { bytes: Buffer.alloc(4096), used: 4096 }

/** Where `verifyCodeChallenge` puts the two challenges it compares, so as not to allocate each time. */
const challengeBytes = { computed: Buffer.alloc(43), stored: Buffer.alloc(43) }

/**
 * An iterator with nothing left: where the walk stands in an empty shard, so as not to make one
 * per step. A Map's, like the others the walk meets, so that V8 sees one kind of iterator.
 */
const NOTHING_TO_WALK: IterableIterator<[never, never]> = new Map<never, never>().entries()

/**
 * A Map of entries that expire, split in 64 shards by the first character of their keys (hashes
 * in base64url, so evenly: each character is one of 64). V8 rehashes a whole table when it grows
 * or shrinks, and a table of a million entries stops the server for tens of milliseconds; a
 * shard, for a sixty-fourth of that. Expired entries are found by walking the shards, a few
 * steps a call, so nothing is kept per entry but the entry. `expiresAt` is in seconds here (see
 * `StoredGrant`).
 */
export class ExpiringMap<V extends { expiresAt: number }> {
  readonly #shards = Array.from({ length: 64 }, () => new Map<string, V>())
  /** Where the sweep goes on from: a Map iterator survives deletes and inserts. */
  #walkShard = 0
  #walkEntries: IterableIterator<[string, V]> = NOTHING_TO_WALK

  #shard(key: string): Map<string, V> {
    return this.#shards[BASE64URL_VALUES[key.charCodeAt(0) & 127]]
  }

  get size(): number {
    let size = 0
    for (const shard of this.#shards) size += shard.size
    return size
  }

  get(key: string): V | undefined {
    return this.#shard(key).get(key)
  }

  has(key: string): boolean {
    return this.#shard(key).has(key)
  }

  set(key: string, value: V): this {
    this.#shard(key).set(key, value)
    return this
  }

  delete(key: string): boolean {
    return this.#shard(key).delete(key)
  }

  /**
   * Takes up to `budget` steps of the walk, deleting what it finds expired, or `gone`: a step
   * looks at one entry, or moves on to the next shard. A full round takes as many steps as
   * entries, plus 64; one call takes one round at most.
   */
  sweep(now: number, budget: number, gone?: (entry: V) => boolean): void {
    if (budget <= 0) return
    const nowSeconds = now / 1000
    let steps = 0
    // A round ends back in the shard where it began, which it may have begun halfway through.
    for (let shardsLeft = 64; ; shardsLeft--) {
      const shard = this.#shards[this.#walkShard]
      // `for…of` goes on where the walk stopped last time: a Map iterator has no `return`, so
      // leaving the loop early does not close it. Unlike `next()` by hand, V8 allocates nothing.
      for (const [key, entry] of this.#walkEntries) {
        if (entry.expiresAt <= nowSeconds || gone?.(entry) === true) shard.delete(key)
        if (++steps === budget) return
      }
      if (shardsLeft === 0) return
      this.#walkShard = (this.#walkShard + 1) & 63
      const next = this.#shards[this.#walkShard]
      this.#walkEntries = next.size === 0 ? NOTHING_TO_WALK : next.entries()
      if (++steps === budget) return
    }
  }

  *[Symbol.iterator](): IterableIterator<[string, V]> {
    for (const shard of this.#shards) yield* shard
  }

  *keys(): IterableIterator<string> {
    for (const shard of this.#shards) yield* shard.keys()
  }
}

// A million live tokens, each with a grant of its own, must fit in 300 MB of heap. So the store
// keeps grants and tokens in a smaller shape than the one the rest of Latch sees:
// - Times are whole seconds since 1970: an expiry rounded up, so that nothing ends early, and so
//   the `exp` a token is introspected with. V8 keeps an integer up to 2^31 (until 2038) inside
//   the field; milliseconds since 1970 would each take a box of 16 bytes of their own.
// - The parts most grants share (client, name, `me`, scope, token lifetime) are one object, kept once.
// - Scope lists too are kept once, however many tokens hold them.
// A read returns a fresh record in the usual shape.

type GrantedApp = Pick<Grant, 'client_id' | 'client_name' | 'me' | 'scope' | 'resource' | 'accessTokenTtlSeconds'>

// Classes, not object literals, so that V8 gives them shapes of their own: literals with the
// same fields as a `Token` would share its shape, in which the times are boxed.

/** A grant as the store keeps it: times in seconds, and the parts that many grants share in `app`. */
class StoredGrant {
  readonly app: GrantedApp
  readonly approvedAt: number
  lastUsedAt: number
  readonly endsAt: number | undefined
  readonly expiresAt: number
  lastRotated: string | undefined

  constructor(grant: Grant, app: GrantedApp, lastRotated: string | undefined) {
    this.app = app
    this.approvedAt = toSeconds(grant.approvedAt)
    this.lastUsedAt = toSeconds(grant.lastUsedAt)
    this.endsAt = grant.endsAt === undefined ? undefined : toSeconds(grant.endsAt, 'up')
    this.expiresAt = toSeconds(grant.expiresAt, 'up')
    this.lastRotated = lastRotated
  }

  toGrant(): Grant {
    const { client_id, client_name, me, scope, resource, accessTokenTtlSeconds } = this.app
    return {
      client_id,
      client_name,
      me,
      scope,
      resource,
      accessTokenTtlSeconds,
      approvedAt: this.approvedAt * 1000,
      lastUsedAt: this.lastUsedAt * 1000,
      endsAt: this.endsAt === undefined ? undefined : this.endsAt * 1000,
      expiresAt: this.expiresAt * 1000,
      lastRotated: this.lastRotated,
    }
  }
}

/** A token as the store keeps it: times in seconds. */
class StoredToken {
  readonly kind: Token['kind']
  readonly grantId: string
  readonly scope: string[]
  readonly resource: string[]
  readonly issuedAt: number
  readonly expiresAt: number
  usedAt: number | undefined

  constructor(token: Token, scope: string[], resource: string[]) {
    this.kind = token.kind
    this.grantId = token.grantId
    this.scope = scope
    this.resource = resource
    this.issuedAt = toSeconds(token.issuedAt)
    this.expiresAt = toSeconds(token.expiresAt, 'up')
    this.usedAt = token.usedAt === undefined ? undefined : toSeconds(token.usedAt)
  }

  toToken(): Token {
    const { kind, grantId, scope, resource, issuedAt, expiresAt, usedAt } = this
    return {
      kind,
      grantId,
      scope,
      resource,
      issuedAt: issuedAt * 1000,
      expiresAt: expiresAt * 1000,
      usedAt: usedAt === undefined ? undefined : usedAt * 1000,
    }
  }
}

/**
 * Whole seconds, as a small integer where it fits: `Math.floor` alone may hand back a boxed
 * number. An expiry is rounded up, so that nothing dies before the `expires_in` it was issued with.
 */
function toSeconds(ms: number, round: 'down' | 'up' = 'down'): number {
  const seconds = round === 'up' ? Math.ceil(ms / 1000) : Math.floor(ms / 1000)
  return (seconds | 0) === seconds ? seconds | 0 : seconds
}

/**
 * A copy of a string that holds nothing else. V8 keeps a string cut from a longer one (a
 * parameter cut from a request URL, say) as a slice of it, so a pending request that kept a
 * parameter as it was parsed would keep the whole request URL alive.
 */
function detached(text: string): string {
  return Buffer.from(text, 'utf8').toString('utf8')
}

// --- Configuration --------------------------------------------------------------
// Every setting is an environment variable and the same-named flag (`--code-ttl 10m`), but the
// two secrets, variables only; a flag wins over the variable, and an empty value counts as unset.

/**
 * The settings with their defaults and one line of help each; `--help` prints this table. Frozen:
 * `loadConfig` reads its defaults here, for every Latch in the process.
 */
export const SETTINGS = deepFrozen([
  { name: 'PORT', default: '3000', help: 'Port to listen on (0 = any free port; the real one is printed).' },
  { name: 'HOST', default: '127.0.0.1', help: 'Interface to bind; localhost binds 127.0.0.1.' },
  { name: 'ISSUER', default: 'http://HOST:PORT', help: 'Public base URL; every endpoint URL is built from it.' },
  { name: 'ME', default: 'ISSUER + /', help: "The owner's profile URL." },
  {
    name: 'PASSWORD_HASH',
    default: 'unset',
    help: 'Owner password hash from `npx tsx server.ts hash-password`. Unset: no password, loopback only.',
  },
  {
    name: 'PASSWORD_SIGN_IN',
    default: 'on',
    help:
      '`off`: sign in with a passkey only (start is refused while none is for the host of ISSUER). ' +
      'Needs PASSWORD_HASH, an ISSUER where passkeys work (a host name on https, or localhost) and a DATA_FILE.',
  },
  {
    name: 'DATA_FILE',
    default: 'latch-data.jsonl',
    help:
      'File where codes, grants, tokens, sessions and passkeys survive restarts; ' +
      '`memory` keeps them in memory only.',
  },
  { name: 'CODE_TTL', default: '300', help: 'Authorization code lifetime (90s, 10m; at most 600 seconds).' },
  { name: 'ACCESS_TOKEN_TTL', default: '604800', help: 'Access token lifetime (7 days).' },
  {
    name: 'REFRESH_TOKEN_TTL',
    default: '2592000',
    help: 'A refresh token expires after this long without use (30 days; longer than ACCESS_TOKEN_TTL).',
  },
  {
    name: 'REFRESH_TOKEN_GRACE',
    default: '30',
    help: 'A refresh token sent again this soon, before the client went on from it, is a retry (0: none; at most 600).',
  },
  {
    name: 'SESSION_TTL',
    default: '604800',
    help: 'How long you stay signed in after signing in, with the password or a passkey (7 days).',
  },
  {
    name: 'INTROSPECTION_SECRET',
    default: 'unset',
    help: 'Unset: /introspect is open. Set: callers send `Authorization: Bearer <secret>`.',
  },
  {
    name: 'TRUST_PROXY',
    default: 'unset',
    help: 'Proxy addresses or ranges (127.0.0.1,10.0.0.0/8) whose X-Forwarded-For gives the client address.',
  },
  { name: 'LOG_FORMAT', default: 'text', help: '`json` writes each log line as a JSON object.' },
  {
    name: 'CLIENT_FETCH_PRIVATE',
    default: 'unset',
    help: '`allow` lets client discovery fetch apps on private addresses (a LAN); loopback stays forbidden.',
  },
  { name: 'PROFILE_NAME', default: 'unset', help: 'Your name, shown to apps granted the profile scope.' },
  { name: 'PROFILE_URL', default: 'ME', help: 'Your home page, shown to apps granted the profile scope.' },
  { name: 'PROFILE_PHOTO', default: 'unset', help: 'URL of your photo, shown to apps granted the profile scope.' },
  {
    name: 'PROFILE_EMAIL',
    default: 'unset',
    help: 'Your email address, shown to apps granted the profile and email scopes.',
  },
] as const)

/** A list of objects, frozen with each of its objects. */
function deepFrozen<T extends readonly object[]>(list: T): T {
  for (const item of list) Object.freeze(item)
  return Object.freeze(list)
}

type SettingName = (typeof SETTINGS)[number]['name']

/** The settings that are secrets, which are read from the environment only: never a flag. */
const SECRET_SETTINGS: ReadonlySet<SettingName> = new Set(['PASSWORD_HASH', 'INTROSPECTION_SECRET'])

/** A setting that stops start-up; the message names the setting and the fix. */
export class ConfigError extends Error {}

const LOOPBACK_HOSTS = new Set(['127.0.0.1', '::1', 'localhost'])
const MAX_CODE_TTL_SECONDS = 600
const MIN_SECRET_LENGTH = 16
/** NIST SP 800-63B-4 §3.1.1.2 (2025): 15 characters for a password that signs in alone, as this one does. */
const MIN_PASSWORD_LENGTH = 15
/**
 * The longest password `hash-password` takes: sent in a form, percent-encoded, it stays well
 * under the 64 KiB a body may hold. NIST SP 800-63B-4 asks that at least 64 be allowed.
 */
const MAX_PASSWORD_LENGTH = 1024
const MAX_DURATION_SECONDS = 3650 * 86400
const MAX_REFRESH_GRACE_SECONDS = 600

/** The most rotations a `MemoryStore` keeps what they issued of, for retries (`#rotatedTo`). */
const MAX_RECENT_ROTATIONS = 10_000

/**
 * Reads the configuration from environment variables and command-line flags, or throws a
 * `ConfigError` that says what to fix. It reads nothing itself: pass `process.env` and
 * `process.argv.slice(2)`.
 * `boundPort` replaces a `PORT` of 0 in the default issuer once the real port is known.
 * @see https://indieauth.spec.indieweb.org/#issuer-identifier IndieAuth §3.1 (issuer)
 */
export function loadConfig(
  env: Record<string, string | number | undefined>,
  argv: readonly string[] = [],
  options: { boundPort?: number } = {},
): Config {
  const raw = readSettings(env, argv)
  const port = parsePort(raw.PORT ?? defaultOf('PORT'))
  const written = raw.HOST ?? defaultOf('HOST')
  // an IPv6 address as a URL writes it, [::1], is that address
  const bracketed = /^\[(.*)\]$/.exec(written)?.[1]
  if (bracketed !== undefined && !isIPv6(bracketed))
    throw new ConfigError(`HOST ${written} is not an IPv6 address in brackets: use one, as in HOST=::1`)
  const named = bracketed ?? written
  // an address, or a name to look up; the default ISSUER is made of it, so a bad one must be named here
  if (isIP(named) === 0 && (!/^[A-Za-z0-9.-]+$/.test(named) || !URL.canParse(`http://${named}/`)))
    throw new ConfigError(`HOST ${written} is not an IP address or a host name: use one, as in HOST=127.0.0.1`)
  if (named.includes('%'))
    throw new ConfigError(
      `HOST ${written} names an interface (${named.slice(named.indexOf('%'))}), which a URL cannot carry: ` +
        'use an address without one, as in HOST=::1',
    )
  // as a URL writes it, so that it compares as itself: 0:0:0:0:0:0:0:1 is ::1, LOCALHOST localhost
  const canonical = unbracketed(new URL(`http://${hostForUrl(named)}/`).hostname)
  // Node would bind `localhost` to the first address it resolves to, ::1 on many systems, where
  // the links to 127.0.0.1 reach nothing; browsers try both for the name, so the issuer keeps it
  const host = canonical === 'localhost' ? '127.0.0.1' : canonical
  const issuer = parseIssuer(raw.ISSUER ?? `http://${hostForUrl(canonical)}:${options.boundPort ?? port}`)
  const me = parseMe(raw.ME ?? `${issuer}/`)
  const passwordHash = raw.PASSWORD_HASH
  if (passwordHash !== undefined && parsePasswordHash(passwordHash) === undefined)
    throw new ConfigError(passwordHashProblem(passwordHash))
  if (passwordHash === undefined && !LOOPBACK_HOSTS.has(host)) {
    throw new ConfigError(
      `HOST ${written} is not 127.0.0.1, ::1 or localhost, and without PASSWORD_HASH anyone who reaches it ` +
        'could approve sign-ins: ' +
        'create a hash with `npx tsx server.ts hash-password` and set PASSWORD_HASH, or bind HOST=127.0.0.1',
    )
  }
  // every address: no browser can use http://0.0.0.0, and a form posted to it from a page opened elsewhere is refused
  const listensOn = new URL(`http://${hostForUrl(host)}/`).hostname
  if (raw.ISSUER === undefined && ['0.0.0.0', '[::]', '[::ffff:0:0]'].includes(listensOn)) {
    throw new ConfigError(
      `HOST ${written} listens on every address, so Latch cannot tell the URL browsers will use: set ISSUER to it, ` +
        `as in ISSUER=http://192.168.1.10:${port}, or to the https URL of the proxy in front`,
    )
  }
  if (passwordHash === undefined && !LOOPBACK_HOSTS.has(unbracketed(new URL(issuer).hostname))) {
    throw new ConfigError(
      `ISSUER ${issuer} is not on a loopback host, and behind a proxy anyone could approve sign-ins ` +
        'without PASSWORD_HASH: ' +
        'create a hash with `npx tsx server.ts hash-password` and set PASSWORD_HASH',
    )
  }
  const passwordSignIn = (raw.PASSWORD_SIGN_IN ?? defaultOf('PASSWORD_SIGN_IN')) !== 'off'
  if (raw.PASSWORD_SIGN_IN !== undefined && raw.PASSWORD_SIGN_IN !== 'off' && raw.PASSWORD_SIGN_IN !== 'on')
    throw new ConfigError(`PASSWORD_SIGN_IN ${raw.PASSWORD_SIGN_IN} is not a choice: set it to off or on`)
  if (!passwordSignIn && passwordHash === undefined)
    throw new ConfigError(
      'PASSWORD_SIGN_IN=off turns off a password that is not set: set PASSWORD_HASH (sessions are tied to it), ' +
        'or leave PASSWORD_SIGN_IN unset',
    )
  const noPasskeys = passkeyHostProblem(issuer)
  if (!passwordSignIn && noPasskeys !== undefined)
    throw new ConfigError(
      `PASSWORD_SIGN_IN=off leaves only passkeys, which cannot work on ISSUER ${issuer}. ${noPasskeys}`,
    )
  const dataFile = raw.DATA_FILE ?? defaultOf('DATA_FILE')
  const codeTtlSeconds = parseDuration('CODE_TTL', raw.CODE_TTL ?? defaultOf('CODE_TTL'))
  if (codeTtlSeconds > MAX_CODE_TTL_SECONDS) {
    throw new ConfigError('CODE_TTL is longer than the 10 minutes IndieAuth recommends at most: use 600 or less')
  }
  const accessTokenTtlSeconds = parseDuration('ACCESS_TOKEN_TTL', raw.ACCESS_TOKEN_TTL ?? defaultOf('ACCESS_TOKEN_TTL'))
  const refreshTokenTtlSeconds = parseDuration(
    'REFRESH_TOKEN_TTL',
    raw.REFRESH_TOKEN_TTL ?? defaultOf('REFRESH_TOKEN_TTL'),
  )
  const refreshTokenGraceSeconds = parseDuration(
    'REFRESH_TOKEN_GRACE',
    raw.REFRESH_TOKEN_GRACE ?? defaultOf('REFRESH_TOKEN_GRACE'),
    { allowZero: true }, // 0 turns it off
  )
  if (refreshTokenGraceSeconds > MAX_REFRESH_GRACE_SECONDS) {
    throw new ConfigError(
      'REFRESH_TOKEN_GRACE is longer than 10 minutes, which would let a stolen refresh token go unnoticed: ' +
        'use 600 or less',
    )
  }
  const sessionTtlSeconds = parseDuration('SESSION_TTL', raw.SESSION_TTL ?? defaultOf('SESSION_TTL'))
  const introspectionSecret = raw.INTROSPECTION_SECRET
  if (introspectionSecret !== undefined && introspectionSecret.length < MIN_SECRET_LENGTH) {
    throw new ConfigError(
      `INTROSPECTION_SECRET is shorter than ${MIN_SECRET_LENGTH} characters: ` +
        'use a long random value, such as the output of `openssl rand -base64 32`',
    )
  }
  // one word of visible ASCII, as `Authorization: Bearer` carries it: a passphrase with spaces could never be sent
  if (introspectionSecret !== undefined && !/^[\x21-\x7e]+$/.test(introspectionSecret)) {
    throw new ConfigError(
      'INTROSPECTION_SECRET holds a character an Authorization header cannot carry (a space, say): ' +
        'use a long random value, such as the output of `openssl rand -base64 32`',
    )
  }
  const clientFetchPrivate = raw.CLIENT_FETCH_PRIVATE === 'allow'
  if (raw.CLIENT_FETCH_PRIVATE !== undefined && !clientFetchPrivate) {
    throw new ConfigError(
      `CLIENT_FETCH_PRIVATE ${raw.CLIENT_FETCH_PRIVATE} is not a choice: set it to allow, or leave it unset`,
    )
  }
  const trustProxy = parseTrustProxy(raw.TRUST_PROXY ?? '')
  if (passwordHash === undefined && trustProxy.length > 0) {
    throw new ConfigError(
      'TRUST_PROXY names a proxy, and without PASSWORD_HASH anyone it lets through could approve sign-ins: ' +
        'create a hash with `npx tsx server.ts hash-password` and set PASSWORD_HASH, or unset TRUST_PROXY',
    )
  }
  const logFormat = raw.LOG_FORMAT ?? defaultOf('LOG_FORMAT')
  if (logFormat !== 'text' && logFormat !== 'json')
    throw new ConfigError(`LOG_FORMAT ${logFormat} is not a choice: set it to json or text, or leave it unset`)
  const profile = {
    name: raw.PROFILE_NAME,
    url: parseProfileLink('PROFILE_URL', raw.PROFILE_URL ?? me),
    photo: raw.PROFILE_PHOTO === undefined ? undefined : parseProfileLink('PROFILE_PHOTO', raw.PROFILE_PHOTO),
    email: raw.PROFILE_EMAIL === undefined ? undefined : parseEmail(raw.PROFILE_EMAIL),
  }
  return {
    port,
    host,
    issuer,
    me,
    passwordHash,
    passwordSignIn,
    dataFile,
    codeTtlSeconds,
    accessTokenTtlSeconds,
    refreshTokenTtlSeconds,
    refreshTokenGraceSeconds,
    sessionTtlSeconds,
    introspectionSecret,
    clientFetchPrivate,
    profile,
    trustProxy,
    logFormat,
  }
}

/** The proxies of `TRUST_PROXY`: addresses, or ranges as an address and a prefix length. */
function parseTrustProxy(value: string): string[] {
  const entries = value.split(/[\s,]+/).filter((entry) => entry !== '')
  for (const entry of entries) {
    const [address, prefix, extra] = entry.split('/')
    const family = isIP(address)
    const bits = family === 4 ? 32 : 128
    if (
      family === 0 ||
      extra !== undefined ||
      (prefix !== undefined && !(/^\d{1,3}$/.test(prefix) && Number(prefix) <= bits))
    )
      throw new ConfigError(
        `TRUST_PROXY ${entry} is not an IP address or range: ` +
          "list your proxy's address, such as 127.0.0.1 or 10.0.0.0/8",
      )
    // a client inside it names its own address in X-Forwarded-For, and so escapes the per-address limits
    if (prefix !== undefined && isWiderThanAProxyNetwork(address, Number(prefix)))
      throw new ConfigError(
        `TRUST_PROXY ${entry} is wider than a network of proxies could be (an IPv4 /8, fc00::/7, another IPv6 /16), ` +
          'and every client in it could choose its own address: ' +
          "list only your proxy's addresses, such as 127.0.0.1 or 10.0.0.0/8",
      )
  }
  return entries
}

/**
 * True for a range wider than the widest private networks, 10.0.0.0/8 and fc00::/7, or, for
 * other IPv6 addresses, than a /16 (the networks of the largest proxies are /20s and /29s). An
 * IPv4 client is checked against IPv6 ranges too, as ::ffff:a.b.c.d, so their IPv4 part is
 * measured as IPv4: ::ffff:0:0/96 and ::/8 hold every IPv4 address.
 */
function isWiderThanAProxyNetwork(address: string, prefix: number): boolean {
  if (isIP(address) === 4) return prefix < 8
  const mapped = plainAddress(new SocketAddress({ address, family: 'ipv6' }).address)
  if (isIP(mapped) === 4) return prefix < 96 + 8 // ::ffff:10.0.0.0/104 is 10.0.0.0/8
  const range = new BlockList()
  range.addSubnet(address, prefix, 'ipv6')
  if (prefix < 7 || range.check('0.0.0.0', 'ipv4')) return true
  return prefix < 16 && !UNIQUE_LOCAL.check(address, 'ipv6') // 2a00::/7 is all of one region's Internet
}

const UNIQUE_LOCAL = new BlockList()
UNIQUE_LOCAL.addSubnet('fc00::', 7, 'ipv6')

/**
 * A setting's default, as `SETTINGS` lists it: the one place defaults are written, but for the
 * three made from other settings (ISSUER, ME and PROFILE_URL), which `loadConfig` works out.
 */
function defaultOf(name: SettingName): string {
  return SETTINGS.find((setting) => setting.name === name)?.default ?? ''
}

/**
 * Merges variables and flags into one value per setting, each a bare string (`requireString`,
 * `requireBareValue`); empty values count as unset.
 */
function readSettings(env: Record<string, unknown>, argv: readonly string[]) {
  const values: Partial<Record<SettingName, string>> = {}
  for (const { name } of SETTINGS) {
    const value = requireString(name, env[name])
    if (value !== undefined && value !== '') values[name] = requireBareValue(name, value)
  }
  // a setting misspelled by case or underscores (`dataFile`, `DATAFILE`, as an embedding app may
  // write it) would be dropped without a word: the password, or the data file, with it
  for (const key of Object.keys(env)) {
    const meant = SETTINGS.find(({ name }) => key !== name && squeeze(key) === squeeze(name))?.name
    if (meant !== undefined && env[key] !== undefined && env[key] !== '')
      throw new ConfigError(`${key} is not a setting: settings are written as ${meant}`)
  }
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]
    const equals = arg.indexOf('=')
    const flag = equals === -1 ? arg : arg.slice(0, equals)
    // a flag misspelled by case or dashes (`--dataFile`) is named as it is written
    const name = SETTINGS.find((setting) => squeeze(flagName(setting.name)) === squeeze(flag))?.name
    if (name === undefined)
      throw new ConfigError(`Unknown option ${flag}: run \`npx tsx server.ts --help\` for the list`)
    // every user of the machine reads a process's arguments (`ps`): a secret goes in the environment
    if (SECRET_SETTINGS.has(name))
      throw new ConfigError(
        `${flag} would show ${name} to every user of this machine (ps lists a command's arguments): ` +
          `set the ${name} variable instead, in the environment or the service's EnvironmentFile`,
      )
    if (flag !== flagName(name)) throw new ConfigError(`Unknown option ${flag}: it is written ${flagName(name)}`)
    const value = equals === -1 ? argv[++i] : arg.slice(equals + 1)
    if (value === undefined) throw new ConfigError(`Option ${flag} needs a value, as in \`${flag} VALUE\``)
    if (value === '') delete values[name]
    else values[name] = requireBareValue(name, value, flag)
  }
  return values
}

/**
 * A value given to `loadConfig` as a string, or as a finite number, which is read as its decimal
 * string (`{ CODE_TTL: 300 }`, as settings read from JSON have it). Anything else (`true`, a list,
 * a `URL`) is refused, naming the setting, where a method of strings would fail on it naming none.
 */
function requireString(name: SettingName, value: unknown): string | undefined {
  if (value === undefined || typeof value === 'string') return value
  if (typeof value === 'number' && Number.isFinite(value)) return String(value)
  const example = defaultOf(name) // a literal one, as 300, but not unset or ISSUER + /
  const asIn = example !== 'unset' && /^[a-z0-9.-]+$/.test(example) ? `, as in '${example}'` : ''
  throw new ConfigError(`${name} must be a string or a number${asIn}, not ${kindOf(value)}`)
}

/** What a value is, in words: `an array`, `null`, `NaN`. */
function kindOf(value: unknown): string {
  if (typeof value === 'number') return String(value) // NaN or Infinity
  if (value === null) return 'null'
  if (Array.isArray(value)) return 'an array'
  return typeof value === 'object' ? 'an object' : `a ${typeof value}`
}

/**
 * The value, or a `ConfigError` when something no setting begins or ends with is around it: a
 * carriage return (an env file with Windows line endings, sourced by a shell), white space, or
 * quotes (an env file read without a shell, as docker's `--env-file` reads it, keeps them); or a
 * comment after it (` # …`), which systemd's EnvironmentFile keeps. Taken as written, they name
 * another file, or make a good value look wrong.
 * `written` is how the setting was given: its variable, or its flag.
 */
function requireBareValue(name: SettingName, value: string, written: string = name): string {
  // as JSON, where a \r is seen, and the white space JSON keeps as it is (a byte order mark, say) as \u escapes
  const json = JSON.stringify(value).replace(/[^\S ]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`)
  const shown = SECRET_SETTINGS.has(name) ? written : `${written} ${json}` // a secret is never shown
  if (value.endsWith('\r'))
    throw new ConfigError(
      `${shown} ends in a carriage return (its file has Windows line endings): remove it, ` +
        'or convert the file with dos2unix',
    )
  if (/^\s|\s$/.test(value)) throw new ConfigError(`${shown} has white space around it: remove it`)
  if (/^(["']).*\1$/s.test(value))
    throw new ConfigError(`${shown} has quotes around it (an env file read without a shell keeps them): remove them`)
  // systemd's EnvironmentFile keeps what follows a value as part of it. A name is free text, and so
  // is the path of a data file that is there: a new one would start an empty journal beside the old
  const freeText = name === 'PROFILE_NAME' || (name === 'DATA_FILE' && existsSync(value))
  if (!freeText && /\s#/.test(value))
    throw new ConfigError(
      `${shown} holds a comment (an env file takes none after a value): put it on a line of its own`,
    )
  return value
}

/** A name without case or separators: `data_file`, `dataFile` and `DATA_FILE` are one. */
function squeeze(name: string): string {
  return name.toUpperCase().replace(/[^A-Z0-9]/g, '')
}

/**
 * What is wrong with a PASSWORD_HASH that Latch does not take, without showing it: how it was
 * damaged on its way into an env file, or its cost.
 */
function passwordHashProblem(value: string): string {
  const fix = 'create one with `npx tsx server.ts hash-password`'
  if (value.startsWith('PASSWORD_HASH=')) return 'PASSWORD_HASH begins with PASSWORD_HASH= again: remove the name'
  if (/\s/.test(value)) return `PASSWORD_HASH holds white space, which a hash has none of: ${fix}`
  const made = PASSWORD_HASH_FORMAT.exec(value)
  if (made === null) return `PASSWORD_HASH is not a hash made by Latch: ${fix}`
  const copied = 'when copied: paste the whole line that hash-password printed'
  if (made[4].length !== 22)
    return `PASSWORD_HASH's salt has ${made[4].length} characters where a hash has 22: it changed ${copied}`
  if (made[5].length !== 43)
    return (
      `PASSWORD_HASH's last part has ${made[5].length} characters where a hash has 43: ` +
      `it was cut short, or joined to more, ${copied}`
    )
  return (
    'PASSWORD_HASH has a cost outside what Latch accepts (ln of 10 or more, r of 8 to 16, p of 1 to 4, ' +
    `and at most 256 MiB of work, 128 · 2^ln · r · p bytes): ${fix}`
  )
}

/** `CODE_TTL` becomes `--code-ttl`. */
function flagName(setting: string): string {
  return `--${setting.toLowerCase().replaceAll('_', '-')}`
}

function parsePort(value: string): number {
  const port = /^\d{1,5}$/.test(value) ? Number(value) : NaN
  if (!(port >= 0 && port <= 65535)) throw new ConfigError(`PORT ${value} is not a port number: use 0 to 65535`)
  return port
}

/**
 * Parses plain seconds or a number with a unit (`90s`, `10m`, `12h`, `7d`) into seconds; 0 only
 * with `allowZero`, for a setting that 0 turns off.
 */
export function parseDuration(name: string, value: string, options: { allowZero?: boolean } = {}): number {
  const match = /^(\d+)([smhd]?)$/.exec(value) // as many digits as come: too many is too long
  const unitSeconds = { '': 1, s: 1, m: 60, h: 3600, d: 86400 }
  const seconds = match === null ? NaN : Number(match[1]) * unitSeconds[match[2] as keyof typeof unitSeconds]
  const allowZero = options.allowZero === true
  if (!(allowZero ? seconds >= 0 : seconds > 0))
    throw new ConfigError(
      allowZero
        ? `${name} ${value} is not a duration: use 0, seconds or a unit, as in 0, 30, 90s or 10m`
        : `${name} ${value} is not a positive duration: use seconds or a unit, as in 300, 90s, 10m, 12h or 7d`,
    )
  if (seconds > MAX_DURATION_SECONDS)
    throw new ConfigError(`${name} ${value} is longer than ten years: use 3650d or less`)
  return seconds
}

function hostForUrl(host: string): string {
  return host.includes(':') ? `[${host}]` : host
}

/** A URL's host name as an address is written elsewhere: `[::1]` is `::1`. */
function unbracketed(hostname: string): string {
  return hostname.replace(/^\[(.*)\]$/, '$1')
}

function parseIssuer(value: string): string {
  const url = URL.canParse(value) ? new URL(value) : undefined
  if (url === undefined || (url.protocol !== 'https:' && url.protocol !== 'http:')) {
    throw new ConfigError(
      `ISSUER ${value} is not an http or https URL: use the public base URL, as in https://auth.example.com`,
    )
  }
  if (url.search !== '' || url.hash !== '' || value.includes('?') || value.includes('#')) {
    throw new ConfigError(
      `ISSUER ${value} has a query or fragment, which RFC 8414 forbids: remove everything from ? or #`,
    )
  }
  if (url.username !== '' || url.password !== '') {
    throw new ConfigError(`ISSUER ${quotable(value)} contains a user name or password: remove it`)
  }
  return url.href.replace(/\/+$/, '')
}

function parseMe(value: string): string {
  const problem = profileUrlProblem(value)
  if (problem === undefined) return canonicalizeUrl(value)
  // a host as people write it (例え.jp): a profile URL carries it only as DNS has it, in punycode
  const host = /^[a-z][a-z0-9+.-]*:\/\/(?:[^/?#]*@)?([^/?#]*)/i.exec(value)?.[1] ?? ''
  if (/[^\x00-\x7f]/.test(host) && URL.canParse(value))
    throw new ConfigError(
      `ME ${quotable(value)} has a host with characters outside ASCII: write the host in punycode, ` +
        `as ${new URL(value).hostname}`,
    )
  throw new ConfigError(
    `ME ${quotable(value)} is not a valid profile URL (${problem}): use your site's URL, as in https://example.com/`,
  )
}

function parseProfileLink(name: string, value: string): string {
  if (!/^https?:\/\//i.test(value) || !URL.canParse(value))
    throw new ConfigError(
      `${name} ${value} is not an http or https URL: use a full URL, as in ` +
        `https://example.com/${name === 'PROFILE_PHOTO' ? 'photo.jpg' : ''}`,
    )
  const url = new URL(value)
  // as ISSUER and ME: the profile goes to every app granted it, and a password with it
  if (url.username !== '' || url.password !== '')
    throw new ConfigError(`${name} ${quotable(value)} contains a user name or password: remove it`)
  return url.href
}

/** A URL as a refusal quotes it, to a terminal or a service's journal: without the password it may hold. */
function quotable(value: string): string {
  return value.replace(/^([a-z][a-z0-9+.-]*:\/\/)[^/?#]*@/i, '$1…@')
}

function parseEmail(value: string): string {
  if (!/^[^\s@]+@[^\s@]+$/.test(value))
    throw new ConfigError(`PROFILE_EMAIL ${value} is not an email address: use one like me@example.com`)
  return value
}

/** Whether `key` is `name` with one letter added, dropped or changed, or two swapped; names of five or more. */
function isTypoOf(key: string, name: string): boolean {
  if (key === name || name.length < 5 || Math.abs(key.length - name.length) > 1) return false
  let i = 0
  while (key[i] === name[i]) i++
  const swapped = key[i] === name[i + 1] && key[i + 1] === name[i] && key.slice(i + 2) === name.slice(i + 2)
  return (
    key.slice(i + 1) === name.slice(i + 1) ||
    key.slice(i) === name.slice(i + 1) ||
    key.slice(i + 1) === name.slice(i) ||
    swapped
  )
}

/** True when `ME` is the default: the issuer's own home page. */
function hasDefaultMe(config: Config): boolean {
  return config.me === `${config.issuer}/`
}

/**
 * Start-up warnings for settings that work but are not right for real use, and for variables of
 * `env` one letter away from a setting's name (`ISUER`), which are not read.
 */
export function configWarnings(config: Config, env: Record<string, string | undefined> = {}): string[] {
  const warnings: string[] = []
  for (const [key, value] of Object.entries(env)) {
    const meant =
      /^[A-Z][A-Z0-9_]{4,}$/.test(key) && value ? SETTINGS.find(({ name }) => isTypoOf(key, name)) : undefined
    if (meant !== undefined)
      warnings.push(`${key} is not a setting, and is not read: if it was meant as ${meant.name}, rename it`)
  }
  const issuer = new URL(config.issuer)
  const host = unbracketed(issuer.hostname)
  const loopback = LOOPBACK_HOSTS.has(host) || isLocalhostName(host)
  const family = (name: string) =>
    name === '::1' ? 'IPv6' : isIP(name) === 4 && name.startsWith('127.') ? 'IPv4' : undefined
  if (issuer.protocol === 'http:' && !loopback && family(host) === undefined) {
    warnings.push(
      `ISSUER ${config.issuer} is http on a non-loopback host; IndieAuth wants https, ` +
        'so put Latch behind TLS and set ISSUER to the https URL',
    )
  }
  // unset, or set to where Latch listens (under any loopback name): behind a proxy, browsers are
  // handed URLs they cannot reach
  const ownHost = loopback || host === config.host
  const ownAddress = issuer.protocol === 'http:' && ownHost && Number(issuer.port || 80) === config.port
  if (config.trustProxy.length > 0 && ownAddress) {
    warnings.push(
      `ISSUER is ${config.issuer}, Latch's own address (as it is when unset), but TRUST_PROXY says ` +
        'requests come through a proxy: ' +
        'the forms and links Latch hands browsers would point here, past it; set ISSUER to the public URL ' +
        'the proxy serves Latch at',
    )
  }
  // Latch's own port on a loopback address it does not listen on: nothing answers there
  const ownPort = Number(issuer.port || (issuer.protocol === 'https:' ? 443 : 80)) === config.port
  const everyIpv4 = config.host === '0.0.0.0'
  const written = isIP(config.host) === 6 ? embeddedIpv4(config.host) : undefined // ::ffff:127.0.0.1 is 127.0.0.1
  const listens =
    host === config.host || host === written || config.host === '::' || (everyIpv4 && family(host) === 'IPv4')
  if (family(host) !== undefined && ownPort && !listens) {
    const [where, instead] = everyIpv4 ? ['every IPv4 address', '127.0.0.1'] : [config.host, hostForUrl(config.host)]
    warnings.push(
      `ISSUER ${config.issuer} is on ${host}, but Latch listens on ${where} only: browsers sent to ISSUER reach ` +
        `nothing; set ISSUER to http://${instead}:${config.port}${everyIpv4 ? '' : ', or leave it unset'}`,
    )
  }
  const { refreshTokenTtlSeconds: refresh, accessTokenTtlSeconds: access } = config
  if (refresh <= access && refresh < MAX_DURATION_SECONDS) {
    warnings.push(
      `REFRESH_TOKEN_TTL (${refresh} s) is not longer than ACCESS_TOKEN_TTL (${access} s): a refresh token ` +
        'runs out no later than the access token it renews, so apps must sign in again, even those approved ' +
        'until revoked; make REFRESH_TOKEN_TTL longer',
    )
  }
  if (access * MAX_REFRESHES_A_DAY < DAY_MS / 1000) {
    warnings.push(
      `ACCESS_TOKEN_TTL (${access} s) is so short that an app renewing its token as it runs out refreshes ` +
        `more than the ${MAX_REFRESHES_A_DAY} times a day a grant may, and is refused until the day is over; ` +
        `make it ${Math.ceil(DAY_MS / 1000 / MAX_REFRESHES_A_DAY)} seconds or more`,
    )
  }
  const me = new URL(config.me)
  // the default, the issuer's home page, is said in the start-up block instead
  if (!hasDefaultMe(config) && (me.port !== '' || isIpAddress(me.hostname))) {
    warnings.push(
      `ME ${config.me} has a port or an IP address, which IndieAuth forbids for profile URLs; ` +
        "fine for trying Latch, but set ME to your site's URL for real use",
    )
  }
  return warnings
}

// --- Command line ---------------------------------------------------------------
// `npx tsx server.ts [--flag value …]` serves; `npx tsx server.ts hash-password` makes a hash.

/** The `--help` text: usage, then the settings table. */
export function buildHelp(): string {
  const rows = SETTINGS.flatMap((setting) => [
    `  ${setting.name}, ${flagOrNot(setting.name)}  (default: ${setting.default})`,
    ...wrap(setting.help, 80 - 6).map((line) => `      ${line}`),
  ])
  return [
    'Latch: an IndieAuth authorization server.',
    '',
    'Usage:',
    '  npx tsx server.ts [--flag value ...]  serve (the flags are below)',
    '  npx tsx server.ts hash-password       read a password, print its PASSWORD_HASH',
    '  npx tsx server.ts --help              print this help',
    '',
    'Every setting is an environment variable or a flag (but the two secrets,',
    'which a flag would show to every user); a flag wins. Durations take seconds',
    'or 90s, 10m, 12h, 7d.',
    '',
    ...rows,
  ].join('\n')
}

/** A setting's flag, for the help: a secret has none. */
function flagOrNot(name: SettingName): string {
  return SECRET_SETTINGS.has(name) ? 'variable only' : flagName(name)
}

/** Breaks text into lines of at most `width` characters, at spaces. */
function wrap(text: string, width: number): string[] {
  const lines: string[] = []
  let line = ''
  for (const word of text.split(' ')) {
    if (line !== '' && line.length + 1 + word.length > width) {
      lines.push(line)
      line = word
    } else line = line === '' ? word : `${line} ${word}`
  }
  return line === '' ? lines : [...lines, line]
}

/** Reads a password from the terminal without echo, or from piped standard input. */
async function readPassword(): Promise<string> {
  if (!process.stdin.isTTY) {
    const chunks: Buffer[] = []
    for await (const chunk of process.stdin) chunks.push(chunk)
    // decoded whole, as a character may come in two chunks; without the byte order mark an
    // editor may begin a file with (Notepad's), which no browser sends
    const text = Buffer.concat(chunks)
      .toString('utf8')
      .replace(/^\ufeff/, '')
    if (/[\0\ufffd]/.test(text)) throw notUtf8() // bytes that are no UTF-8, or UTF-16's zeros
    return withoutControlKeys(text.split(/\r?\n/)[0])
  }
  // what comes after the first Enter in one chunk (a pasted "password⏎password⏎") is the second
  const typed = { ahead: '' }
  // the terminal stays raw from the first prompt to the last Enter: between the two, a key typed
  // ahead would be echoed
  const first = await promptHidden(`Password (${MIN_PASSWORD_LENGTH} characters or more): `, typed, true)
  // both are read, hidden, before either is judged: refused at once, a second entry typed ahead
  // would go to the shell, shown on the screen and kept in its history
  const second = await promptHidden('Again: ', typed)
  refuseWeakPassword(withoutControlKeys(first))
  if (withoutControlKeys(first) !== withoutControlKeys(second))
    throw new ConfigError('The two passwords differ: run the command again')
  return first
}

function promptHidden(prompt: string, typed: { ahead: string }, another = false): Promise<string> {
  // raw first, then the prompt: a key typed the moment it shows must not be echoed by the terminal
  process.stdin.setRawMode(true)
  process.stderr.write(prompt)
  process.stdin.setEncoding('utf8')
  return new Promise((resolve) => {
    const text: string[] = [] // by code point, so that Backspace never leaves half of one (🔑 is two halves)
    const onData = (chunk: string): boolean => {
      const chars = [...chunk]
      for (const [i, char] of chars.entries()) {
        if (char === '\u0003' || char === '\u0004') process.exit(130) // Ctrl-C, or Ctrl-D: given up
        if (char === '\r' || char === '\n') {
          if (!another) process.stdin.setRawMode(false) // no other prompt follows
          process.stdin.pause()
          process.stdin.off('data', onData)
          process.stderr.write('\n')
          typed.ahead = chars.slice(char === '\r' && chars[i + 1] === '\n' ? i + 2 : i + 1).join('') // one Enter
          resolve(text.join(''))
          return true
        }
        // Backspace erases a code point; Ctrl-U, as in passwd and sudo, all typed so far
        if (char === '\u007f' || char === '\b') text.pop()
        else if (char === '\u0015') text.length = 0
        else text.push(char)
      }
      return false
    }
    const ahead = typed.ahead
    typed.ahead = ''
    if (onData(ahead)) return
    process.stdin.on('data', onData)
    process.stdin.resume()
  })
}

const HASH_PASSWORD_HELP = `Usage: npx tsx server.ts hash-password

Asks for a password twice (${MIN_PASSWORD_LENGTH} to ${MAX_PASSWORD_LENGTH} characters, in UTF-8), without showing it,
and prints the line to set as PASSWORD_HASH. Piped in, the first line is the password.`

/** Refuses an arrow key or Esc typed at the hidden prompt: a sign-in form could never type it back. */
function withoutControlKeys(password: string): string {
  if (/[\x00-\x1f\x7f]/.test(password)) {
    throw new ConfigError(
      'The password holds a control key (an arrow, Esc, Tab), which no sign-in form can type: ' +
        'run the command again and type only the password',
    )
  }
  return password
}

function notUtf8(): ConfigError {
  return new ConfigError(
    'The password is not UTF-8, as every browser sends it: set the terminal, or the file piped in, ' +
      'to UTF-8 and run the command again',
  )
}

async function runHashPassword(): Promise<void> {
  const password = await readPassword()
  refuseWeakPassword(password)
  const passwordHash = await hashPassword(password)
  process.stdout.write(`${passwordHash}\n`) // the command's one line of output, for PASSWORD_HASH
}

function refuseWeakPassword(password: string): void {
  if (password === '') {
    throw new ConfigError(
      `No password was given (its input was empty): type one of ${MIN_PASSWORD_LENGTH} characters or more, ` +
        'or pipe it in as the first line',
    )
  }
  if ([...password].length < MIN_PASSWORD_LENGTH) {
    throw new ConfigError(
      `The password is shorter than ${MIN_PASSWORD_LENGTH} characters, the least NIST SP 800-63B-4 allows ` +
        'for a password that signs in on its own: choose a longer one, a few words are easy to remember',
    )
  }
  // bytes that are not UTF-8 (a terminal in Latin-1) decode to U+FFFD, which no form sends for them
  if (password.includes('\ufffd')) throw notUtf8()
  if ([...password].length > MAX_PASSWORD_LENGTH) {
    throw new ConfigError(
      `The password is longer than ${MAX_PASSWORD_LENGTH} characters, more than a sign-in form is sure to ` +
        'send whole: choose a shorter one',
    )
  }
}

const NO_PASSWORD = 'not set: anyone who can reach this loopback address can approve sign-ins'

/** Prints what the server is doing, once, at start-up. */
function printStartup(
  config: Config,
  env: Record<string, string | undefined>,
  listeningUrl: string,
  store: MemoryStore | FileStore,
): void {
  const memory = store instanceof FileStore ? store.memory : store
  const now = Date.now()
  // counted where they are kept: a snapshot (`records`) would copy 100,000 tokens to count them
  const live = { code: 0, grant: memory.grants.size, token: 0, passkey: memory.passkeys.size }
  // a redeemed code is kept only to recognise a replay
  for (const code of memory.codes.values()) if (code.usedAt === undefined && code.expiresAt > now) live.code++
  // a used one (a rotated refresh token) is kept only to recognise its reuse
  for (const [, token] of memory.tokens)
    if (token.usedAt === undefined && token.expiresAt * 1000 > now && memory.grants.has(token.grantId)) live.token++
  const tokens = `${countOf(live.token, 'live token')} and ${countOf(live.grant, 'grant')}`
  const loaded = `${countOf(live.code, 'live code')}, ${tokens}`
  const data =
    config.dataFile === 'memory'
      ? 'in memory only: codes and tokens are lost when the server stops'
      : `${config.dataFile}: ${loaded} loaded`
  const forHere = passkeysForHere([...memory.passkeys], config).length
  const passkeys = `${countOf(live.passkey, 'passkey')}${forHere < live.passkey ? `, ${forHere} for this host` : ''}`
  const password =
    config.passwordHash === undefined
      ? NO_PASSWORD
      : config.passwordSignIn
        ? `set, and ${passkeys}`
        : `off: ${passkeys}`
  const isDefaultMe = hasDefaultMe(config)
  const metadata = `${config.issuer}/.well-known/oauth-authorization-server`
  // under a path, RFC 8414 §3.1 puts the metadata at the origin's root, outside Latch (README, Embedding)
  const issuer = new URL(config.issuer)
  const metadataAtRoot = issuer.pathname === '/' ? undefined : `${issuer.origin}${metadataPath(config)}`
  if (config.logFormat === 'json') {
    const time = new Date().toISOString()
    for (const warning of configWarnings(config, env))
      console.log(JSON.stringify({ time, event: 'warning', message: warning }))
    const start = {
      issuer: config.issuer,
      me: config.me,
      password,
      data,
      listening: listeningUrl,
      metadataAtRoot,
      metadata,
    }
    return void console.log(JSON.stringify({ time, event: 'start', message: 'Latch is listening', ...start }))
  }
  for (const warning of configWarnings(config, env)) console.log(`warning: ${warning}`)
  console.log(
    [
      `Latch is listening on ${listeningUrl}`,
      `  issuer    ${config.issuer}`,
      `  me        ${config.me}${isDefaultMe ? ' (the default, this page: set ME to your site)' : ''}`,
      `  password  ${password}`,
      `  data      ${data}`,
      ...(metadataAtRoot === undefined
        ? []
        : [`  oauth     ${metadataAtRoot}: OAuth and MCP clients look there; pass it to the metadata below`]),
      `  metadata  ${metadata}`,
    ].join('\n'),
  )
}

/**
 * Closes a debugger open at start without being asked for (a SIGUSR1 before `main` could listen
 * for it, or a preload that opened one), and says whether it did. One asked for with `--inspect`,
 * `--inspect-brk` or `--inspect-wait`, on the command line or in NODE_OPTIONS, is left open;
 * `--inspect-port` only says where one would listen.
 */
async function closeDebuggerNotAskedFor(): Promise<boolean> {
  // NODE_OPTIONS as Node reads it: words, or quoted strings
  const options = [...(process.env.NODE_OPTIONS ?? '').matchAll(/"((?:[^"\\]|\\.)*)"|(\S+)/g)]
  const flags = [...process.execArgv, ...options.map(([, quoted, word]) => quoted ?? word)]
  if (flags.some((flag) => /^--inspect(-brk|-wait)?(=|$)/.test(flag))) return false
  const inspector = await import('node:inspector').catch(() => undefined) // a Node built without one has none
  if (inspector?.url() === undefined) return false
  inspector.close()
  return true
}

/** Runs the command line: serve, `hash-password`, or `--help`. */
async function main(argv: string[], env: Record<string, string | undefined>): Promise<void> {
  // Node opens its debugger at SIGUSR1, on a port any user of the machine may connect to and run
  // code in Latch from; rotation scripts written for nginx send it. A listener keeps it shut from
  // here on, and one a SIGUSR1 opened while Node was still loading this file is closed.
  let onSignal = () => {}
  process.on('SIGUSR1', () => onSignal())
  const debuggerClosed = await closeDebuggerNotAskedFor()
  if (argv[0] === 'hash-password') {
    if (argv.length === 1) return runHashPassword()
    if (argv[1] === '--help' || argv[1] === '-h') return void console.log(HASH_PASSWORD_HELP)
    // not said back: it may be the password, which the shell's history now holds
    throw new ConfigError('hash-password takes no arguments: it asks for the password, twice')
  }
  if (argv.includes('--help') || argv.includes('-h')) return void console.log(buildHelp())
  let config = loadConfig(env, argv)
  // the lines of the store (the journal's) and of the log writer itself, in the log's format
  const format = (line: string) => {
    const [, event = 'store', message = line] = /^(\w+): ([^]*)$/.exec(line) ?? []
    return formatLogEntry({ time: new Date().toISOString(), event, message }, config.logFormat)
  }
  // standard output sent to a file is written directly: a full disk then costs lines, not the whole log
  const write = createLineWriter(isFile(1) ? 1 : process.stdout, 100, format)
  const logMessage = (line: string) => write(format(line))
  onSignal = () => logMessage('SIGUSR1: ignored (Latch reopens nothing; no debugger is opened)')
  if (debuggerClosed)
    logMessage('SIGUSR1: a debugger open at start without --inspect was closed (start with --inspect to debug)')
  if (!config.passwordSignIn && config.dataFile === 'memory')
    throw new ConfigError(
      'PASSWORD_SIGN_IN=off leaves only passkeys, and DATA_FILE=memory keeps none from one start to the next: ' +
        'set DATA_FILE to a file, sign in with the password and add a passkey on /apps first',
    )
  const noPasskey = () =>
    new ConfigError(
      `PASSWORD_SIGN_IN=off, and ${config.dataFile} holds no passkey, so no one could sign in: ` +
        'unset PASSWORD_SIGN_IN, sign in with the password and add a passkey on /apps first',
    )
  if (!config.passwordSignIn && !existsSync(config.dataFile)) throw noPasskey() // refused before it is made
  const store = await openStore(config, { log: logMessage }).catch((err: NodeJS.ErrnoException) => {
    throw dataFileProblem(err, config.dataFile) ?? err
  })
  const passkeys = await store.listPasskeys()
  if (!config.passwordSignIn && passkeys.length === 0) throw noPasskey()
  if (!config.passwordSignIn && passkeysForHere(passkeys, config).length === 0) {
    const hosts = [...new Set(passkeys.map(([, passkey]) => passkey.rpId))]
    const counted = passkeys.length === 1 ? 'the 1 passkey' : `the ${passkeys.length} passkeys`
    throw new ConfigError(
      `PASSWORD_SIGN_IN=off, and ${counted} in ${config.dataFile} ` +
        `${passkeys.length === 1 ? 'was' : 'were'} made for ${hosts.join(', ')}, ` +
        `not ${new URL(config.issuer).hostname}, so no one could sign in: ` +
        `set ISSUER back to ${hosts.length === 1 ? 'that host' : 'one of those hosts'}, ` +
        'or unset PASSWORD_SIGN_IN, sign in with the password and add a passkey for this one',
    )
  }
  const server = createLatchServer(SERVER_TIMEOUTS, CONNECTION_LIMITS, logMessage)
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject)
    server.listen(config.port, config.host, resolve)
  }).catch((err: NodeJS.ErrnoException) => {
    if (err.code === 'EADDRINUSE')
      throw new ConfigError(
        `PORT ${config.port} is in use on ${config.host}: stop the other server, or pick another port, as in PORT=3001`,
      )
    if (err.code === 'EADDRNOTAVAIL' || err.code === 'ENOTFOUND' || err.code === 'EAI_AGAIN')
      throw new ConfigError(
        `HOST ${config.host} is not an address of this machine: use 127.0.0.1, or an interface this machine has`,
      )
    if (err.code === 'EINVAL')
      throw new ConfigError(
        `HOST ${config.host} cannot be listened on without naming an interface (a link-local address), ` +
          'which a URL cannot carry: use 127.0.0.1, or another address of this machine',
      )
    if (err.code === 'EACCES')
      throw new ConfigError(
        `PORT ${config.port} may not be bound by this user (below 1024, that takes root or CAP_NET_BIND_SERVICE): ` +
          'use a port such as 3000',
      )
    throw err
  })
  const address = server.address()
  const port = typeof address === 'object' && address !== null ? address.port : config.port
  if (config.port === 0) config = loadConfig(env, argv, { boundPort: port })
  const log = write
  server.on('request', createHandler({ config, store, log }))
  // SIGINT, SIGTERM, and SIGHUP too: the terminal that started it was closed, or a script meant
  // to have the log reopened. A stop ends by exit 0, or, where a terminal may have gone (a
  // hang-up, or one started on a terminal), by the signal itself, the log written first: Node's
  // own exit resets the terminal's modes, and aborts when the terminal is gone.
  const onTerminal = [0, 1, 2].some((fd) => isatty(fd))
  let stopping: NodeJS.Signals | undefined
  let hungUp = false
  const end = (signal: NodeJS.Signals) => {
    write.flush()
    if (!hungUp && !onTerminal) process.exit(0)
    const last = hungUp ? 'SIGHUP' : signal
    process.removeAllListeners(last)
    process.kill(process.pid, last)
  }
  for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.on(signal, () => {
      if (stopping !== undefined) {
        hungUp ||= signal === 'SIGHUP' // a terminal closing sends two, and may close mid-stop
        if (signal === 'SIGINT' && stopping === 'SIGINT') end('SIGINT') // a second Ctrl-C: stop at once
        return // else the stop under way goes on
      }
      stopping = signal
      hungUp = signal === 'SIGHUP'
      // after the lines of requests already answered
      logMessage(`${signal}: finishing requests in flight, then stopping`)
      void closeLatchServer(server).then(async () => {
        if (store instanceof FileStore) await store.close()
        end(signal)
      })
    })
  }
  // last: a supervisor may signal as soon as it reads this
  printStartup(config, env, `http://${hostForUrl(config.host)}:${port}`, store)
}

function isFile(fd: number): boolean {
  try {
    return fstatSync(fd).isFile()
  } catch {
    return false // closed
  }
}

/** The one line to print when the data file cannot be opened, or undefined for a failure of another kind. */
function dataFileProblem(err: NodeJS.ErrnoException, dataFile: string): ConfigError | undefined {
  // a path relative to the working folder, which a service sets and a person may not know: named whole too
  const named = isAbsolute(dataFile) ? dataFile : `${dataFile} (${resolve(dataFile)})`
  const because: Record<string, string> = {
    EISDIR: `is a directory: name a file in it, as in DATA_FILE=${dataFile.replace(/\/$/, '')}/latch.jsonl`,
    ENOTDIR: 'is inside a file, not a folder: choose a path whose folders are folders',
    EEXIST: 'is inside a file, not a folder: choose a path whose folders are folders',
    EACCES: 'cannot be read or written by this user: give the user its folder, or choose a path it owns',
    EPERM:
      'cannot be written, even by its owner: it may be marked immutable (lsattr shows an i; chattr -i clears it), ' +
      'or be on a file system that forbids it',
    EROFS: 'is on a read-only file system: choose a writable path, such as a state directory',
    ENOSPC: 'cannot be written: the disk is full. Free some space, or choose another disk',
    ENOENT: 'has a folder that cannot be created: create it, or choose another path',
    ELOOP: 'is a symbolic link that leads back to itself: point it at a file',
    ENAMETOOLONG: 'is a path longer than the file system allows: choose a shorter one',
    ERR_FS_FILE_TOO_LARGE: 'is larger than 2 GiB, which Latch cannot read: move it away and start empty',
  }
  const reason = err.code === undefined ? undefined : because[err.code]
  // a file put back by another user (a restore as root, without its chown): the file is what to fix
  const file = err.code === 'EACCES' ? statOf(dataFile) : undefined
  const self = process.getuid?.()
  if (file !== undefined && self !== undefined && file.uid !== self) {
    return new ConfigError(
      `DATA_FILE ${named} belongs to another user (uid ${file.uid}), so this one cannot read or write it: ` +
        `give it to this user (uid ${self}), as in chown ${self} ${resolve(dataFile)}`,
    )
  }
  // this user's own file, which its mode keeps from it (`install -m 400`, a chmod a-w): the mode is what to fix
  if (file !== undefined && self !== undefined && (file.mode & 0o600) !== 0o600) {
    const cannot = ['readable', 'writable'].filter((_, i) => (file.mode & (0o400 >> i)) === 0).join(' or ')
    return new ConfigError(
      `DATA_FILE ${named} is not ${cannot} by its owner, this user (${modeOf(file)}): ` +
        `run chmod 600 ${resolve(dataFile)}`,
    )
  }
  // a folder of this user's own, which its mode keeps from it (a chmod u-w): the mode is what to fix
  const folder = err.code === 'EACCES' ? ownFolderModeProblem(resolve(dataFile)) : undefined
  if (folder !== undefined) return new ConfigError(`DATA_FILE ${named} ${folder}`)
  // its own folder exists (Latch made it): the folder of a symbolic link's target is what is missing
  const target = err.code === 'ENOENT' ? linkTarget(dataFile) : undefined
  if (target !== undefined && !existsSync(dirname(target))) {
    return new ConfigError(
      `DATA_FILE ${named} is a symbolic link to ${target}, whose folder does not exist: ` +
        `create ${dirname(target)}, or point the link elsewhere`,
    )
  }
  return reason === undefined ? undefined : new ConfigError(`DATA_FILE ${named} ${reason}`)
}

/**
 * Why a file cannot be made or rewritten in its folder (or in the folders still to be made for
 * it), when the nearest folder there is belongs to this user and its mode is the cause: Latch
 * lists, makes and renames files in it, so it needs all three of read, write and search.
 */
function ownFolderModeProblem(path: string): string | undefined {
  let folder = dirname(path)
  let stats = statOf(folder)
  while (stats === undefined && dirname(folder) !== folder) stats = statOf((folder = dirname(folder)))
  if (stats === undefined || stats.uid !== process.getuid?.() || (stats.mode & 0o700) === 0o700) return undefined
  return (
    `is in a folder of this user's that its mode keeps it from using (${folder}, ${modeOf(stats)}), ` +
    `where the journal is made and rewritten as it grows: run chmod u+rwx ${folder}`
  )
}

/** What a file's owner and mode are, or undefined when it cannot be looked at. */
function statOf(path: string): Stats | undefined {
  try {
    return statSync(path)
  } catch {
    return undefined
  }
}

/**
 * Makes a folder, and those above it that are missing, each with `mode`. Node's own `mkdir` with
 * `recursive` never returns for a folder that cannot be made in a parent that exists, such as
 * one under /proc (ENOENT each time); this one fails there.
 */
async function makeFolders(path: string, mode: number): Promise<void> {
  const existing = (err: NodeJS.ErrnoException) => (err.code === 'EEXIST' ? undefined : Promise.reject(err))
  const made = await mkdir(path, { mode }).then(
    () => true,
    (err: NodeJS.ErrnoException) => (err.code === 'ENOENT' && dirname(path) !== path ? false : existing(err)),
  )
  if (made !== false) return
  await makeFolders(dirname(path), mode) // a folder above is missing: make it, then try this one once more
  await mkdir(path, { mode }).catch(existing)
}

/** Where a symbolic link leads in the end, as an absolute path, or undefined when the path is not one. */
function linkTarget(path: string): string | undefined {
  let target = path
  for (let hops = 0; hops < 40; hops++) {
    let next: string
    try {
      next = readlinkSync(target)
    } catch {
      break // not a link: the end of the chain
    }
    target = resolve(dirname(target), next) // a relative target is relative to the link's folder
  }
  return target === path ? undefined : target
}

/**
 * Whether node was asked to run this file as Latch's command, rather than an app that imports it.
 * A bundler that inlines this file into an app's one file makes that file this module too. Such a
 * file does not begin with Latch's first comment: bundlers put imports first, and drop plain
 * comments or move licence comments to its end. A copy of this file does, once past what a tool
 * or a licence may put on top (a byte-order mark, a `#!` line, `"use strict"`, blank lines and
 * comments); so does one compiled alone, since that comment opens with `/*!`, which compilers and
 * minifiers keep. Any other file starts nothing.
 */
function runsAsCommand(): boolean {
  if (process.argv[1] === undefined) return false
  try {
    const path = realpathSync(process.argv[1])
    if (path !== realpathSync(fileURLToPath(import.meta.url))) return false
    const start = Buffer.alloc(65_536)
    const fd = openSync(path, 'r')
    const read = readSync(fd, start)
    closeSync(fd)
    const latch = /^\/\*[*!]\r?\n \* Latch: /
    const passedOver = /^(\s+|\/\/.*|\/\*[^]*?\*\/|(['"])use strict\2;?)/
    let text = start
      .toString('utf8', 0, read)
      .replace(/^\uFEFF/, '')
      .replace(/^#!.*/, '')
    while (!latch.test(text)) {
      const rest = text.replace(passedOver, '')
      if (rest === text) return false
      text = rest
    }
    return true
  } catch {
    return false
  }
}

if (runsAsCommand()) {
  main(process.argv.slice(2), process.env).catch((err: unknown) => {
    console.error(err instanceof ConfigError ? `latch: ${err.message}` : err)
    process.exit(1)
  })
}
