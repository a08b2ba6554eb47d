// Browser test: a person signs in to a small client app with Latch, in Debian's Chromium driven by
// playwright-core. The client links to /auth with PKCE; the person reads the consent page, types
// the password (wrong once), approves, and lands back at the client, which exchanges the code at
// /token. Then /apps lists the app, Revoke ends its token, and a second sign-in needs no password.
//
// Without /usr/bin/chromium the tests are skipped with the reason printed; with CI set they fail.
// The screenshots in docs/screenshots are taken by test/pages.test.ts.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { SKIP, launchChromium } from './chromium.ts'
import { close, listen } from './harness.ts'
import type { Listening } from './harness.ts'
import type { Browser, BrowserContext, Locator, Page } from 'playwright-core'
import { computeCodeChallenge, createHandler, createSecret, escapeHtml, hashPassword, loadConfig } from '../server.ts'

// --- Harness ----------------------------------------------------------------------

const PASSWORD = 'correct horse battery staple'
const ME = 'https://example.com/'
const VIEWPORT = { width: 420, height: 900 }

/** Starts Latch on 127.0.0.1 and a free port, with the owner's password set. */
async function startLatch(): Promise<Listening & { issuer: string }> {
  const env = { PORT: '0', ME, PASSWORD_HASH: await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 }) }
  let handler: (req: IncomingMessage, res: ServerResponse) => void = () => {}
  const latch = await listen((req, res) => handler(req, res))
  const config = loadConfig(env, [], { boundPort: Number(new URL(latch.base).port) })
  handler = createHandler({ config, log: () => {} })
  return { ...latch, issuer: config.issuer }
}

type ClientApp = Listening & { clientId: string; tokens: string[] }

/**
 * The app a person signs in to: `/` links to Latch with a fresh state and PKCE verifier, which it
 * keeps; `/callback` checks state and iss, exchanges the code at /token and keeps the token.
 */
async function startClient(latch: { base: string; issuer: string }): Promise<ClientApp> {
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
        me: ME,
      })
      return page(
        res,
        200,
        'Example app',
        `<a href="${escapeHtml(`${latch.base}/auth?${query}`)}">Sign in with your website</a>`,
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

async function introspect(latch: { base: string }, token: string): Promise<Record<string, unknown>> {
  const response = await fetch(`${latch.base}/introspect`, { method: 'POST', body: new URLSearchParams({ token }) })
  assert.equal(response.status, 200)
  return (await response.json()) as Record<string, unknown>
}

/** Opens the client's page and follows its sign-in link to Latch's consent page. */
async function startSignIn(page: Page, client: ClientApp): Promise<void> {
  await page.goto(client.base)
  await page.getByRole('link', { name: 'Sign in with your website' }).click()
  await page.waitForURL((url) => url.pathname === '/auth')
}

// --- The walk ---------------------------------------------------------------------

describe('A person signs in with a browser (issue 6)', () => {
  let latch: Awaited<ReturnType<typeof startLatch>>
  let client: ClientApp
  let browser: Browser
  let context: BrowserContext
  let page: Page

  before(async () => {
    if (SKIP !== false) return
    latch = await startLatch()
    client = await startClient(latch)
    browser = await launchChromium()
    context = await browser.newContext({ viewport: VIEWPORT, deviceScaleFactor: 2 })
    context.setDefaultTimeout(5000)
    page = await context.newPage()
  })

  after(async () => {
    await browser?.close()
    if (client !== undefined) await close(client)
    if (latch !== undefined) await close(latch)
  })

  it('shows the consent page, naming the app, with a password field', { skip: SKIP }, async () => {
    await startSignIn(page, client)
    await assertVisibleText(page.locator('main'), client.clientId)
    await assertVisibleText(page.locator('main'), ME)
    assert.equal(await page.getByLabel('Password').count(), 1)
    assert.equal(await page.getByRole('checkbox').count(), 2)
  })

  it('says a wrong password is wrong and keeps the page usable', { skip: SKIP }, async () => {
    await page.getByLabel('Password').fill('not the password')
    await page.getByRole('button', { name: 'Approve' }).click()
    await page.getByRole('alert').waitFor()
    assert.equal(new URL(page.url()).pathname, '/auth/consent')
    await assertVisibleText(page.locator('main'), client.clientId)
    assert.equal(await page.getByLabel('Password').inputValue(), '')
    assert.equal(client.tokens.length, 0)
  })

  it('approves with the password and lands at the client, signed in', { skip: SKIP }, async () => {
    await page.getByLabel('Password').fill(PASSWORD)
    await page.getByRole('button', { name: 'Approve' }).click()
    await page.waitForURL((url) => url.origin === client.base && url.pathname === '/callback')
    assert.equal(await page.getByRole('heading').innerText(), 'Signed in')
    assert.equal(await page.locator('#me').innerText(), ME)
    assert.equal(client.tokens.length, 1)
    assert.equal((await introspect(latch, client.tokens[0])).active, true)
  })

  it('lists the app at /apps without a second sign-in', { skip: SKIP }, async () => {
    await page.goto(`${latch.base}/apps`)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'Connected apps')
    const app = page.locator('section.app')
    assert.equal(await app.count(), 1)
    assert.equal(await app.getByRole('heading').innerText(), client.clientId)
    await assertVisibleText(app, 'profile create')
  })

  it('revokes the app, and its token becomes inactive at once', { skip: SKIP }, async () => {
    await page.getByRole('button', { name: 'Revoke', exact: true }).click()
    await page.waitForURL((url) => url.pathname === '/apps/revoke')
    assert.match(await page.getByRole('status').innerText(), /^Revoked .+: its tokens stopped working\.$/)
    await page.getByText('No app holds a token right now.').waitFor()
    assert.deepEqual(await introspect(latch, client.tokens[0]), { active: false })
  })

  it('asks for no password on a second sign-in in the same browser', { skip: SKIP }, async () => {
    await startSignIn(page, client)
    await assertVisibleText(page.locator('main'), client.clientId)
    assert.equal(await page.locator('input[type=password]').count(), 0)
    await page.getByRole('button', { name: 'Approve' }).click()
    await page.waitForURL((url) => url.origin === client.base && url.pathname === '/callback')
    assert.equal(await page.getByRole('heading').innerText(), 'Signed in')
    assert.equal(client.tokens.length, 2)
    assert.equal((await introspect(latch, client.tokens[1])).active, true)
    assert.equal((await introspect(latch, client.tokens[0])).active, false)
  })
})

async function assertVisibleText(locator: Locator, text: string): Promise<void> {
  const shown = await locator.innerText()
  assert.ok(shown.includes(text), `expected the page to show ${text}, it shows:\n${shown}`)
}
