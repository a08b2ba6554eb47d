// The bench's only direct calls into a store. The store API is changing: when it does, this
// file is the one to update.

import { MemoryStore, canonicalizeUrl, hashSecret, parseScope } from '../server.ts'

const CLIENT_ID = 'http://127.0.0.1:8080/'
const ME = 'https://example.com/'

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
