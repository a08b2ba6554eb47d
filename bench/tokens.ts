// The bench's only direct calls into a store. The store API is changing: when it does, this
// file is the one to update.

import { FileStore, MemoryStore, canonicalizeUrl, createSecret, hashSecret, parseScope } from '../server.ts'

const CLIENT_ID = 'http://127.0.0.1:8080/'
const ME = 'https://example.com/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
/** The challenge of the RFC 7636 Appendix B verifier, which the bench's exchanges send. */
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'

/** A store for the memory figures: it logs nothing (the caps it logs about are not hit here). */
export function createTokenStore(): MemoryStore {
  return new MemoryStore({ log: () => {} })
}

/**
 * Saves the i-th live access token as a code exchange would: its own grant (a sign-in per token,
 * the worst case) and the access token, keyed by their hashes (`hashSecret`). `client_id` and `scope` are
 * parsed afresh each time, as they are per request, so no string is shared that a server would
 * not share. (A code exchange also issues a refresh token; it is not counted here.)
 */
export async function addLiveToken(store: MemoryStore, i: number, nowMs: number, ttlMs: number): Promise<void> {
  const grantId = hashSecret(`bench-code-${i}`)
  const scope = parseScope('profile create')
  const expiresAt = nowMs + ttlMs
  const grant = {
    client_id: canonicalizeUrl(CLIENT_ID),
    client_name: undefined,
    me: ME,
    scope,
    resource: [],
    accessTokenTtlSeconds: ttlMs / 1000,
    approvedAt: nowMs,
    lastUsedAt: nowMs,
    expiresAt,
  }
  await store.saveGrant(grantId, grant, nowMs)
  await store.saveToken(
    hashSecret(`bench-token-${i}`),
    { kind: 'access', grantId, scope, resource: [], issuedAt: nowMs, expiresAt, usedAt: undefined },
    nowMs,
  )
}

/** Runs one round of whatever sweeping the store does on its own: `sweep(now)` on the server's timer. */
export function sweepExpired(store: MemoryStore, nowMs: number): void {
  store.sweep(nowMs)
}

/** Tokens and grants still held, expired or not. */
export function heldEntries(store: MemoryStore): number {
  return store.tokens.size + store.grants.size
}

/**
 * Writes a data file as a server that had issued them would have left it: `codes` unredeemed
 * codes, valid for ten minutes, and `tokens` live access tokens, each with its own grant. Returns
 * the values, which the file holds only hashes of. Each batch of saves shares one write.
 */
export async function fillDataFile(
  path: string,
  counts: { codes: number; tokens: number },
  nowMs: number,
): Promise<{ codes: string[]; tokens: string[] }> {
  const store = await FileStore.open(path, { log: () => {}, now: () => nowMs })
  const codes = Array.from({ length: counts.codes }, () => createSecret())
  const tokens = Array.from({ length: counts.tokens }, () => createSecret())
  const ttlMs = 86_400_000
  for (let start = 0; start < Math.max(codes.length, tokens.length); start += 1000) {
    const saves: Promise<void>[] = []
    for (const code of codes.slice(start, start + 1000)) {
      const saved = {
        client_id: CLIENT_ID,
        client_name: undefined,
        redirect_uri: REDIRECT_URI,
        code_challenge: CHALLENGE,
        scope: ['profile', 'create'],
        resource: [],
        me: ME,
        accessTokenTtlSeconds: ttlMs / 1000,
        issuedAt: nowMs,
        expiresAt: nowMs + 600_000,
        usedAt: undefined,
      }
      saves.push(store.saveCode(hashSecret(code), saved, nowMs))
    }
    for (const [i, token] of tokens.slice(start, start + 1000).entries()) {
      const grantId = hashSecret(`bench-grant-${start + i}`)
      const grant = {
        client_id: CLIENT_ID,
        client_name: undefined,
        me: ME,
        scope: ['profile', 'create'],
        resource: [],
        accessTokenTtlSeconds: ttlMs / 1000,
        approvedAt: nowMs,
        lastUsedAt: nowMs,
        expiresAt: nowMs + ttlMs,
      }
      const access = { kind: 'access', grantId, scope: grant.scope, resource: [], issuedAt: nowMs, usedAt: undefined }
      saves.push(
        store
          .saveGrant(grantId, grant, nowMs)
          .then(() =>
            store.saveToken(hashSecret(token), { ...access, kind: 'access', expiresAt: grant.expiresAt }, nowMs),
          ),
      )
    }
    await Promise.all(saves)
  }
  await store.close()
  return { codes, tokens }
}
