// Cross-port forgery, in Debian's Chromium driven by playwright-core. Cookies ignore ports: a page
// on another port of 127.0.0.1 is same-site with Latch, and its own Set-Cookie can replace
// Latch's CSRF cookie (`latch_csrf`, Path=/, same name, host and path, so HttpOnly does not
// protect it). The attack page, at http://127.0.0.1:P2/:
//   1. picks a CSRF value X of its own (43 base64url characters);
//   2. for consent, opens an authorization request server-side with `Cookie: latch_csrf=X`, so
//      Latch binds the pending request to X, and reads the request id from the consent page;
//   3. answers the browser with `Set-Cookie: latch_csrf=X; Path=/` and a form that posts itself
//      to Latch with csrf=X: to /auth/consent (decision=approve), /sign-out or /apps/revoke-all.
//      The page's referrer policy is no-referrer, so the POST carries `Origin: null`, as the
//      posts from Latch's own pages do.
// The owner's session cookie (`latch_session`, SameSite=Lax) goes along, because a cross-port
// POST is same-site, and the form's csrf equals the cookie: the double submit check passes.
// Latch must refuse each forged POST with 403, and the owner's real pages must keep working.
//
// Without /usr/bin/chromium the tests are skipped with the reason printed; with CI set they fail.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import { SKIP, launchChromium } from './chromium.ts'
import type { Browser, Page } from 'playwright-core'
import { hashPassword } from '../server.ts'
import { startLatch } from './harness.ts'
import type { TestServer } from './harness.ts'

const PASSWORD = 'correct horse'
/** The PKCE example of RFC 7636 Appendix B. */
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const TIMEOUT = 5000

/** A site on its own port of 127.0.0.1, which is also a loopback client of Latch. */
type Site = {
  base: string
  clientId: string
  redirectUri: string
  callbacks: URLSearchParams[]
  close: () => Promise<void>
}

function authQuery(site: Site, state: string): URLSearchParams {
  return new URLSearchParams({
    response_type: 'code',
    client_id: site.clientId,
    redirect_uri: site.redirectUri,
    state,
    code_challenge: CHALLENGE,
    code_challenge_method: 'S256',
    scope: 'profile create',
  })
}

/**
 * `/callback` records the query it receives. `/consent`, `/sign-out` and `/revoke-all` are the
 * attack: they plant a CSRF cookie of the site's choosing and post a form to Latch with it.
 */
async function startSite(latch: TestServer): Promise<Site> {
  const callbacks: URLSearchParams[] = []
  const server = createServer((req, res) => {
    const url = new URL(req.url ?? '/', site.base)
    const html = (status: number, body: string, headers: Record<string, string> = {}) => {
      res.writeHead(status, { 'Content-Type': 'text/html; charset=utf-8', ...headers })
      res.end(`<!doctype html><html lang="en"><meta charset="utf-8"><title>Site</title>${body}`)
    }
    const forge = async (action: string, fields: [string, string][]) => {
      const csrf = randomBytes(32).toString('base64url')
      const request: [string, string][] = []
      if (action === '/auth/consent') {
        const consent = await fetch(`${latch.base}/auth?${authQuery(site, 'forged')}`, {
          headers: { Cookie: `latch_csrf=${csrf}` },
        })
        const id = /name="request" value="([^"]+)"/.exec(await consent.text())?.[1]
        if (consent.status !== 200 || id === undefined) return html(502, `<p>GET /auth answered ${consent.status}</p>`)
        request.push(['request', id])
      }
      const inputs = [...request, ['csrf', csrf], ...fields]
        .map(([name, value]) => `<input type="hidden" name="${name}" value="${value}">`)
        .join('')
      html(
        200,
        `<meta name="referrer" content="no-referrer"><body onload="document.forms[0].submit()"><form method="post" action="${latch.base}${action}">${inputs}</form>`,
        {
          'Set-Cookie': `latch_csrf=${csrf}; Path=/`,
        },
      )
    }
    const routes: Record<string, () => unknown> = {
      '/callback': () => {
        callbacks.push(url.searchParams)
        html(200, '<h1>Callback</h1>')
      },
      '/consent': () =>
        forge('/auth/consent', [
          ['scope', 'profile'],
          ['scope', 'create'],
          ['decision', 'approve'],
        ]),
      '/sign-out': () => forge('/sign-out', []),
      '/revoke-all': () => forge('/apps/revoke-all', [['confirm', 'yes']]),
    }
    Promise.resolve((routes[url.pathname] ?? (() => html(404, '<h1>Not found</h1>')))()).catch((err: unknown) =>
      html(500, `<pre>${String(err)}</pre>`),
    )
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`
  const site: Site = {
    base,
    clientId: `${base}/`,
    redirectUri: `${base}/callback`,
    callbacks,
    close: () => {
      server.closeAllConnections()
      return new Promise((resolve) => server.close(() => resolve()))
    },
  }
  return site
}

describe('A page on another port of 127.0.0.1 cannot act for the signed-in owner', () => {
  let latch: TestServer
  let attacker: Site
  let app: Site
  let browser: Browser

  before(async () => {
    if (SKIP !== false) return
    latch = await startLatch({ PASSWORD_HASH: await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 }) })
    attacker = await startSite(latch)
    app = await startSite(latch)
    browser = await launchChromium({ timeout: 15_000 })
  })

  after(async () => {
    await browser?.close()
    await attacker?.close()
    await app?.close()
    await latch?.close()
  })

  /** A fresh browser profile in which the owner has signed in at /apps with the password. */
  async function signedInPage(): Promise<Page> {
    const context = await browser.newContext()
    context.setDefaultTimeout(TIMEOUT)
    const page = await context.newPage()
    await page.goto(`${latch.base}/apps`)
    await page.getByLabel('Password').fill(PASSWORD)
    await page.getByRole('button', { name: 'Sign in' }).click()
    await page.waitForURL((url) => url.origin === latch.base && url.pathname === '/apps')
    assert.equal(await appsHeading(page), 'Connected apps')
    return page
  }

  /** The heading of Latch's /apps as this browser sees it: 'Connected apps' only when signed in. */
  async function appsHeading(page: Page): Promise<string> {
    await page.goto(`${latch.base}/apps`)
    return page.getByRole('heading', { level: 1 }).innerText()
  }

  /** Opens an attack page and returns the status Latch gave its forged POST, once the browser settles. */
  async function attack(page: Page, path: string, action: string): Promise<number> {
    const attackUrl = `${attacker.base}${path}`
    const posted = page.waitForResponse(
      (response) => response.url() === `${latch.base}${action}` && response.request().method() === 'POST',
    )
    await page.goto(attackUrl, { waitUntil: 'commit' })
    const status = (await posted).status()
    await page.waitForURL((url) => url.href !== attackUrl)
    return status
  }

  /** The real flow: Latch's consent page for the app, one click on Approve, and the code it lands with. */
  async function approve(page: Page): Promise<string> {
    await page.goto(`${latch.base}/auth?${authQuery(app, 'legit')}`)
    assert.equal(await page.locator('input[type=password]').count(), 0, 'signed in: no password asked')
    await page.getByRole('button', { name: 'Approve' }).click()
    await page.waitForURL((url) => url.origin === app.base && url.pathname === '/callback')
    const query = new URL(page.url()).searchParams
    assert.deepEqual(
      { state: query.get('state'), iss: query.get('iss'), error: query.get('error') },
      { state: 'legit', iss: latch.issuer, error: null },
    )
    const code = query.get('code')
    assert.ok(code !== null)
    return code
  }

  async function exchange(code: string): Promise<string> {
    const body = new URLSearchParams({
      grant_type: 'authorization_code',
      code,
      client_id: app.clientId,
      redirect_uri: app.redirectUri,
      code_verifier: VERIFIER,
    })
    const response = await fetch(`${latch.base}/token`, { method: 'POST', body, signal: AbortSignal.timeout(TIMEOUT) })
    assert.equal(response.status, 200)
    return ((await response.json()) as { access_token: string }).access_token
  }

  async function isActive(token: string): Promise<unknown> {
    const response = await fetch(`${latch.base}/introspect`, {
      method: 'POST',
      body: new URLSearchParams({ token }),
      signal: AbortSignal.timeout(TIMEOUT),
    })
    assert.equal(response.status, 200)
    return ((await response.json()) as { active: unknown }).active
  }

  it(
    'refuses a consent posted from another port, and the real consent page still works',
    { skip: SKIP, timeout: 30_000 },
    async () => {
      const page = await signedInPage()
      const status = await attack(page, '/consent', '/auth/consent')
      const codes = attacker.callbacks.filter((query) => query.has('code')).length
      assert.deepEqual(
        { status, codes },
        { status: 403, codes: 0 },
        'the forged consent is refused and no code reaches the attacker',
      )
      await approve(page)
      await page.context().close()
    },
  )

  it(
    'refuses a sign-out posted from another port, and the owner stays signed in',
    { skip: SKIP, timeout: 30_000 },
    async () => {
      const page = await signedInPage()
      const status = await attack(page, '/sign-out', '/sign-out')
      assert.deepEqual(
        { status, heading: await appsHeading(page) },
        { status: 403, heading: 'Connected apps' },
        'the forged sign-out is refused and the session lives',
      )
      await page.context().close()
    },
  )

  it(
    'refuses a revoke-all posted from another port, and the grant stays live',
    { skip: SKIP, timeout: 30_000 },
    async () => {
      const page = await signedInPage()
      const token = await exchange(await approve(page))
      assert.equal(await isActive(token), true)
      const status = await attack(page, '/revoke-all', '/apps/revoke-all')
      assert.deepEqual(
        { status, active: await isActive(token) },
        { status: 403, active: true },
        'the forged revoke-all is refused and the token stays active',
      )
      assert.equal(await appsHeading(page), 'Connected apps')
      await page.context().close()
    },
  )
})
