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
import { startClient } from './client-app.ts'
import type { ClientApp } from './client-app.ts'
import { close, listen } from './harness.ts'
import type { Listening } from './harness.ts'
import type { Browser, BrowserContext, Locator, Page } from 'playwright-core'
import { createHandler, hashPassword, loadConfig } from '../server.ts'

// --- Harness ----------------------------------------------------------------------

const PASSWORD = 'correct horse battery staple'
const ME = 'https://example.com/'
const VIEWPORT = { width: 420, height: 900 }

/** Starts Latch on 127.0.0.1 and a free port, with the owner's password set. */
async function startLatch(): Promise<Listening & { issuer: string }> {
  const env = {
    PORT: '0',
    ME,
    DATA_FILE: 'memory',
    PASSWORD_HASH: await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 }),
  }
  let handler: (req: IncomingMessage, res: ServerResponse) => void = () => {}
  const latch = await listen((req, res) => handler(req, res))
  const config = loadConfig(env, [], { boundPort: Number(new URL(latch.base).port) })
  handler = createHandler({ config, log: () => {} })
  return { ...latch, issuer: config.issuer }
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

describe('A person signs in with a browser', () => {
  let latch: Awaited<ReturnType<typeof startLatch>>
  let client: ClientApp
  let browser: Browser
  let context: BrowserContext
  let page: Page

  before(async () => {
    if (SKIP !== false) return
    latch = await startLatch()
    client = await startClient({ ...latch, link: latch.base }, ME)
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

  it('says a wrong password is wrong and keeps the page as the person left it', { skip: SKIP }, async () => {
    const create = page.getByRole('checkbox').nth(1)
    await create.uncheck()
    await page.getByLabel('Password').fill('not the password')
    await page.getByRole('button', { name: 'Approve' }).click()
    await page.getByRole('alert').waitFor()
    assert.equal(new URL(page.url()).pathname, '/auth/consent')
    await assertVisibleText(page.locator('main'), client.clientId)
    assert.equal(await page.getByLabel('Password').inputValue(), '')
    assert.equal(await page.getByRole('checkbox').nth(0).isChecked(), true)
    assert.equal(await create.isChecked(), false) // not ticked again behind the person's back
    await create.check()
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
    await page.getByRole('button', { name: `Revoke ${client.clientId}`, exact: true }).click()
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

  it(
    "shows no button in the page's first moments, where another page's double click or key would land",
    { skip: SKIP },
    async () => {
      // the page's first moment, held: Chromium's animations stand still until let go
      const cdp = await context.newCDPSession(page)
      await cdp.send('Animation.enable')
      await cdp.send('Animation.setPlaybackRate', { playbackRate: 0 })
      try {
        await startSignIn(page, client)
        const box = await page.locator('button[value=approve]').boundingBox()
        assert.ok(box !== null)
        const center = [box.x + box.width / 2, box.y + box.height / 2] as const
        type Counted = Window & { submits?: number }
        await page.evaluate(() => {
          const counted = window as Counted
          counted.submits = 0
          document.querySelector('form')?.addEventListener('submit', (event) => {
            if ((event.submitter as HTMLButtonElement | null)?.value === 'approve')
              counted.submits = (counted.submits ?? 0) + 1
            event.preventDefault() // counted, not sent: the code is not the point
          })
        })
        const submits = () => page.evaluate(() => (window as Counted).submits)
        await page.mouse.click(...center)
        assert.equal(await submits(), 0)
        for (let i = 0; i < 12; i++) {
          await page.keyboard.press('Tab')
          assert.notEqual(await page.evaluate(() => document.activeElement?.tagName), 'BUTTON')
        }
        await page.keyboard.press('Enter')
        assert.equal(await submits(), 0)
        await cdp.send('Animation.setPlaybackRate', { playbackRate: 1 })
        await page.evaluate(() => Promise.all(document.getAnimations().map((animation) => animation.finished)))
        // nor, ever, Enter in a checkbox, which would send the form as its first button
        await page.getByRole('checkbox').first().focus()
        await page.keyboard.press('Enter')
        assert.equal(await submits(), 0)
        await page.mouse.click(...center)
        assert.equal(await submits(), 1)
      } finally {
        await cdp.send('Animation.setPlaybackRate', { playbackRate: 1 })
        await cdp.detach()
      }
    },
  )

  it(
    'sends nothing at Enter in a browser that knows no dialog method, which would send a GET',
    { skip: SKIP },
    async () => {
      await startSignIn(page, client)
      const sent = page.waitForRequest((request) => new URL(request.url()).pathname === '/auth/consent')
      const blocked = page
        .evaluate(
          () =>
            new Promise((resolve) => document.addEventListener('securitypolicyviolation', () => resolve('blocked'))),
        )
        .catch(() => 'navigated away')
      // as Firefox before 98 and Safari before 15.4 read it: an unknown method is GET
      await page.evaluate(() => document.querySelector('.no-enter')?.setAttribute('formmethod', 'unknown'))
      await page.getByRole('checkbox').first().press('Enter')
      assert.equal(await Promise.race([blocked, sent.then(() => 'sent')]), 'blocked')
    },
  )

  it(
    'tells a page left open across a sign-out that it is out of date, and changes nothing',
    { skip: SKIP },
    async () => {
      await page.goto(`${latch.base}/apps`)
      const elsewhere = await context.newPage()
      await elsewhere.goto(`${latch.base}/apps`)
      await elsewhere.getByRole('button', { name: 'Sign out', exact: true }).click()
      await elsewhere.getByRole('heading', { level: 1, name: 'Sign in' }).waitFor()
      const [answer] = await Promise.all([
        page.waitForResponse((response) => new URL(response.url()).pathname === '/apps/revoke'),
        page.getByRole('button', { name: `Revoke ${client.clientId}`, exact: true }).click(),
      ])
      assert.equal(answer.status(), 403)
      await assertVisibleText(
        page.locator('main'),
        'This page is out of date: you signed in or out, or your session ended, since it was opened',
      )
      assert.equal((await introspect(latch, client.tokens[1])).active, true)
    },
  )
})

async function assertVisibleText(locator: Locator, text: string): Promise<void> {
  const shown = await locator.innerText()
  assert.ok(shown.includes(text), `expected the page to show ${text}, it shows:\n${shown}`)
}
