// The client app of the browser tests: a small site a person signs in to with Latch, as a real
// IndieAuth client does, with state, PKCE and the check of `iss`.

import type { ServerResponse } from 'node:http'
import { listen } from './harness.ts'
import type { Listening } from './harness.ts'
import { computeCodeChallenge, createSecret, escapeHtml } from '../server.ts'

export type ClientApp = Listening & { clientId: string; tokens: string[] }

/**
 * The app a person signs in to: `/` links to Latch's `/auth` at `latch.link` (its issuer, or the
 * address it listens on) with a fresh state and PKCE verifier, which it keeps; `/callback` checks
 * state and iss, exchanges the code at `latch.base`/token and keeps the token.
 */
export async function startClient(
  latch: { base: string; issuer: string; link: string },
  me: string,
): Promise<ClientApp> {
  const pending = new Map<string, string>() // state → code_verifier
  const tokens: string[] = []
  let clientId = ''
  const page = (res: ServerResponse, status: number, title: string, body: string) => {
    res.writeHead(status, { 'Content-Type': 'text/html; charset=utf-8' })
    res.end(`<!doctype html><html lang="en"><meta charset="utf-8"><title>${title}</title><h1>${title}</h1>${body}`)
  }
  const app = await listen((req, res) => {
    const url = new URL(req.url ?? '/', clientId)
    if (url.pathname === '/') {
      const state = createSecret()
      const verifier = createSecret()
      pending.set(state, verifier)
      const query = new URLSearchParams({
        response_type: 'code',
        client_id: clientId,
        redirect_uri: `${clientId}callback`,
        state,
        code_challenge: computeCodeChallenge(verifier),
        code_challenge_method: 'S256',
        scope: 'profile create',
        me,
      })
      return page(
        res,
        200,
        'Example app',
        `<a href="${escapeHtml(`${latch.link}/auth?${query}`)}">Sign in with your website</a>`,
      )
    }
    if (url.pathname === '/callback') {
      const state = url.searchParams.get('state') ?? ''
      const verifier = pending.get(state)
      pending.delete(state)
      if (verifier === undefined) return page(res, 400, 'Unknown state', '')
      if (url.searchParams.get('iss') !== latch.issuer) return page(res, 400, 'Wrong issuer', '')
      const code = url.searchParams.get('code')
      if (code === null)
        return page(res, 400, 'Not signed in', `<p>${escapeHtml(url.searchParams.get('error') ?? '')}</p>`)
      const body = new URLSearchParams({
        grant_type: 'authorization_code',
        code,
        client_id: clientId,
        redirect_uri: `${clientId}callback`,
        code_verifier: verifier,
      })
      fetch(`${latch.base}/token`, { method: 'POST', body })
        .then(async (response) => {
          const json = (await response.json()) as { access_token?: string; me?: string }
          if (response.status !== 200 || json.access_token === undefined)
            return page(res, 502, 'Token exchange failed', `<pre>${escapeHtml(JSON.stringify(json))}</pre>`)
          tokens.push(json.access_token)
          page(res, 200, 'Signed in', `<p>You are signed in as <span id="me">${escapeHtml(json.me ?? '')}</span>.</p>`)
        })
        .catch((err: unknown) => page(res, 502, 'Token exchange failed', `<pre>${escapeHtml(String(err))}</pre>`))
      return
    }
    page(res, 404, 'Not found', '')
  })
  clientId = `${app.base}/`
  return { ...app, clientId, tokens }
}
