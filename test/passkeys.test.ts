// Browser test: the owner uses a passkey, in Debian's Chromium driven by playwright-core, with a
// virtual authenticator of the DevTools protocol standing in for a phone or a security key. The
// issuer is http://localhost:PORT, a host name, as WebAuthn refuses an address as RP ID. The walk:
// on /apps, signed in with the password, the owner adds a passkey, which the page lists and the
// authenticator holds; signs out and back in with the passkey alone; approves a client app's
// sign-in on the consent page with the passkey, and the client exchanges its code at /token;
// removes the passkey, after which the same key is refused (403, no session). A browser without
// WebAuthn sees no passkey button and signs in with the password. No page breaks its
// Content-Security-Policy on the way.
//
// Without /usr/bin/chromium the tests are skipped with the reason printed; with CI set they fail.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { SKIP, addAuthenticator, launchChromium } from './chromium.ts'
import type { Authenticator } from './chromium.ts'
import { startClient } from './client-app.ts'
import type { ClientApp } from './client-app.ts'
import { close, listen } from './harness.ts'
import type { Listening } from './harness.ts'
import type { Browser, BrowserContext, Locator, Page, Response } from 'playwright-core'
import { MemoryStore, createHandler, hashPassword, loadConfig } from '../server.ts'

// --- Harness ----------------------------------------------------------------------

const PASSWORD = 'correct horse battery staple'
const ME = 'https://example.com/'
const VIEWPORT = { width: 420, height: 900 }
const WAIT = 5000 // every wait of the walk ends after this many milliseconds
const PASSKEY_NAME = 'Laptop key'
/** The WebAuthn user.id Latch registers: the first 16 bytes of sha256("latch user ME at ISSUER"). */
const userHandleAt = (issuer: string) =>
  createHash('sha256').update(`latch user ${ME} at ${issuer}`).digest().subarray(0, 16)

type Latch = Listening & {
  issuer: string
  logs: string[]
  advance: (seconds: number) => void
  /** Serves on with PASSWORD_SIGN_IN on or off, the same store kept. */
  passwordSignIn: (on: boolean) => void
}

/**
 * Starts Latch on 127.0.0.1 and a free port, with the owner's password set, and with its issuer
 * on the host name `localhost`, which the browser reaches at 127.0.0.1 too. `base` stays the
 * address, for the requests of the test and of the client app.
 */
async function startLatch(): Promise<Latch> {
  const logs: string[] = []
  let handler: (req: IncomingMessage, res: ServerResponse) => void = () => {}
  const latch = await listen((req, res) => handler(req, res))
  const port = Number(new URL(latch.base).port)
  const env = {
    PORT: '0',
    ISSUER: `http://localhost:${port}`,
    ME,
    PASSWORD_HASH: await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 }),
    DATA_FILE: 'memory',
  }
  const config = loadConfig(env, [], { boundPort: port })
  let skipped = 0 // the server's clock runs ahead of the real one by this much, never by sleeping
  const store = new MemoryStore({ log: (line) => logs.push(line) })
  const serve = (passwordSignIn: boolean) => {
    const log = (line: string) => logs.push(line)
    handler = createHandler({ config: { ...config, passwordSignIn }, store, log, now: () => Date.now() + skipped })
  }
  serve(true)
  return {
    ...latch,
    issuer: config.issuer,
    logs,
    advance: (seconds) => (skipped += seconds * 1000),
    passwordSignIn: serve,
  }
}

async function introspect(latch: Latch, token: string): Promise<Record<string, unknown>> {
  const response = await fetch(`${latch.base}/introspect`, { method: 'POST', body: new URLSearchParams({ token }) })
  assert.equal(response.status, 200)
  return (await response.json()) as Record<string, unknown>
}

/** What the pages said to the console and threw, and Latch's log: for the CSP check and for failure messages. */
type Watched = { csp: string[]; errors: string[]; logs: string[] }

function watch(page: Page, name: string, seen: Watched): void {
  page.on('console', (message) => {
    if (message.type() !== 'error') return
    const line = `${name} ${page.url()}: ${message.text()}`
    seen.errors.push(line)
    if (message.text().includes('Content Security Policy')) seen.csp.push(line)
  })
  page.on('pageerror', (err) => seen.errors.push(`${name} ${page.url()}: uncaught ${err.message}`))
}

async function credentialsOf({ cdp, authenticatorId }: Authenticator) {
  return (await cdp.send('WebAuthn.getCredentials', { authenticatorId })).credentials
}

/**
 * Clicks a button that submits a form (through passkey.js, or directly) and waits, a bounded time,
 * for the answer to the POST to `path`. On a timeout, says what the page shows and logged.
 */
async function submit(page: Page, button: Locator, path: string, seen: Watched): Promise<Response> {
  try {
    const [response] = await Promise.all([
      page.waitForResponse((r) => r.request().method() === 'POST' && new URL(r.url()).pathname === path, {
        timeout: WAIT,
      }),
      button.click({ timeout: WAIT }),
    ])
    await page.waitForLoadState('load', { timeout: WAIT })
    return response
  } catch (err) {
    throw new Error(`${(err as Error).message}\n${await describePage(page, seen)}`)
  }
}

/** The page's address and text, the console errors so far and Latch's last log lines: a failed step's evidence. */
async function describePage(page: Page, seen: Watched): Promise<string> {
  const text = await page
    .locator('body')
    .innerText({ timeout: 1000 })
    .catch((err: Error) => `(no text: ${err.message})`)
  const errors = seen.errors.length === 0 ? '(none)' : seen.errors.join('\n')
  const logs = seen.logs.slice(-6).join('\n')
  return `page ${page.url()} shows:\n${text}\nconsole errors:\n${errors}\nLatch's last log lines:\n${logs}`
}

async function assertVisibleText(locator: Locator, text: string): Promise<void> {
  const shown = await locator.innerText()
  assert.ok(shown.includes(text), `expected the page to show ${text}, it shows:\n${shown}`)
}

async function heading(page: Page): Promise<string> {
  return page.getByRole('heading', { level: 1 }).innerText()
}

/** The passkeys part of the apps page: the section whose heading is "Passkeys". */
function passkeysSection(page: Page): Locator {
  return page.locator('section').filter({ has: page.getByRole('heading', { name: 'Passkeys', exact: true }) })
}

function passkeyButton(page: Page): Locator {
  return page.getByRole('button', { name: 'Sign in with a passkey' })
}

/** The directives of a Content-Security-Policy header, by name. */
function cspDirectives(response: Response | null): Map<string, string[]> {
  const header = response?.headers()['content-security-policy'] ?? ''
  return new Map(
    header
      .split(';')
      .map((directive) => directive.trim().split(/\s+/))
      .filter((words) => words[0] !== '')
      .map(([name, ...sources]) => [name, sources]),
  )
}

async function signInWithPassword(page: Page, latch: Latch, seen: Watched): Promise<void> {
  await page.getByLabel('Password').fill(PASSWORD)
  const response = await submit(page, page.getByRole('button', { name: 'Sign in', exact: true }), '/sign-in', seen)
  assert.equal(response.status(), 303, await describePage(page, seen))
  await page.waitForURL(`${latch.issuer}/apps`, { timeout: WAIT })
  assert.equal(await heading(page), 'Connected apps')
}

async function signOut(page: Page, seen: Watched): Promise<void> {
  await submit(page, page.getByRole('button', { name: 'Sign out', exact: true }), '/sign-out', seen)
  assert.equal(await heading(page), 'Sign in', await describePage(page, seen))
}

// --- The walk ---------------------------------------------------------------------

describe('The owner signs in with a passkey (WebAuthn) in a browser', () => {
  let latch: Latch
  let client: ClientApp
  let browser: Browser
  let context: BrowserContext
  let page: Page
  let authenticator: Authenticator
  let signCount = 0 // the authenticator's counter for the passkey, as last read
  const seen: Watched = { csp: [], errors: [], logs: [] }
  // a second browser, whose sign-in page was opened while the passkey still existed
  let staleContext: BrowserContext
  let stalePage: Page

  before(async () => {
    if (SKIP !== false) return
    latch = await startLatch()
    seen.logs = latch.logs
    client = await startClient({ ...latch, link: latch.issuer }, ME)
    browser = await launchChromium({ timeout: 15_000 })
    context = await browser.newContext({ viewport: VIEWPORT })
    context.setDefaultTimeout(WAIT)
    context.setDefaultNavigationTimeout(WAIT)
    page = await context.newPage()
    watch(page, 'owner', seen)
    authenticator = await addAuthenticator(context, page)
  })

  after(async () => {
    await browser?.close()
    if (client !== undefined) await close(client)
    if (latch !== undefined) await close(latch)
  })

  it('adds a passkey on /apps: the page lists it and the authenticator holds it', { skip: SKIP }, async () => {
    await page.goto(`${latch.issuer}/apps`)
    assert.equal(await heading(page), 'Sign in', await describePage(page, seen))
    await signInWithPassword(page, latch, seen)
    await page.getByRole('heading', { name: 'Passkeys', exact: true }).waitFor()
    const add = page.getByRole('button', { name: 'Add a passkey' })
    const form = page.locator('form').filter({ has: add })
    await form.locator('input[name=name]').fill(PASSKEY_NAME)
    const response = await submit(page, add, '/passkeys/add', seen)
    assert.equal(response.status(), 200, await describePage(page, seen))
    assert.equal(await page.getByRole('status').innerText(), `Added the passkey ${PASSKEY_NAME}.`)
    const section = passkeysSection(page)
    await assertVisibleText(section, PASSKEY_NAME)
    await assertVisibleText(section, 'Added')
    await assertVisibleText(section, 'Last used')
    await section.getByRole('button', { name: 'Remove' }).waitFor() // buttons show 0.6 s after the page
    assert.equal(await section.getByRole('button', { name: 'Remove' }).count(), 1)

    const credentials = await credentialsOf(authenticator)
    assert.equal(credentials.length, 1)
    assert.equal(credentials[0].rpId, 'localhost')
    assert.equal(credentials[0].isResidentCredential, true)
    assert.deepEqual(Buffer.from(credentials[0].userHandle ?? '', 'base64'), userHandleAt(latch.issuer))
    signCount = credentials[0].signCount
  })

  it('signs out, and signs back in with the passkey alone', { skip: SKIP }, async () => {
    await signOut(page, seen)
    assert.equal(await page.getByLabel('Password').inputValue(), '')
    const response = await submit(page, passkeyButton(page), '/sign-in', seen)
    assert.equal(response.status(), 303, await describePage(page, seen))
    await page.waitForURL(`${latch.issuer}/apps`)
    assert.equal(await heading(page), 'Connected apps')
    // the authenticator signed once more, and the page says when the passkey was last used
    assert.equal((await credentialsOf(authenticator))[0].signCount, ++signCount)
    assert.match(await passkeysSection(page).innerText(), /Last used\s*\d{4}-\d\d-\d\d \d\d:\d\d UTC/)
  })

  it('approves a client app on the consent page with the passkey', { skip: SKIP }, async () => {
    await signOut(page, seen)
    await page.goto(client.base)
    await page.getByRole('link', { name: 'Sign in with your website' }).click()
    await page.waitForURL((url) => url.origin === latch.issuer && url.pathname === '/auth')
    await assertVisibleText(page.locator('main'), client.clientId)
    const response = await submit(
      page,
      page.getByRole('button', { name: 'Approve with a passkey' }),
      '/auth/consent',
      seen,
    )
    assert.equal(response.status(), 303, await describePage(page, seen))
    await page.waitForURL((url) => url.origin === client.base && url.pathname === '/callback')
    assert.equal(await page.getByRole('heading').innerText(), 'Signed in', await describePage(page, seen))
    assert.equal(await page.locator('#me').innerText(), ME)
    assert.equal(client.tokens.length, 1)
    assert.equal((await introspect(latch, client.tokens[0])).active, true)
    assert.equal((await credentialsOf(authenticator))[0].signCount, ++signCount)
  })

  it('is signed in after a consent with the passkey, as after one with the password', { skip: SKIP }, async () => {
    await page.goto(`${latch.issuer}/apps`)
    assert.equal(await heading(page), 'Connected apps', await describePage(page, seen))
    assert.equal(await page.locator('section.app').count(), 1)
  })

  it(
    'approves with the passkey on the consent page with passwords off; Enter sends nothing, never denies',
    { skip: SKIP },
    async () => {
      await signOut(page, seen)
      latch.passwordSignIn(false)
      try {
        await page.goto(client.base)
        await page.getByRole('link', { name: 'Sign in with your website' }).click()
        await page.waitForURL((url) => url.origin === latch.issuer && url.pathname === '/auth')
        const passkey = page.getByRole('button', { name: 'Approve with a passkey' })
        await passkey.waitFor() // shown by the script, 0.6 s after the page
        type Seen = Window & { submitters?: string[] }
        await page.evaluate(() =>
          document.querySelector('form')?.addEventListener('submit', (event) => {
            const seen = window as Seen
            seen.submitters = [...(seen.submitters ?? []), (event.submitter as HTMLElement | null)?.className ?? '']
          }),
        )
        // Enter in a checkbox sends the form by its first button, which sends nothing
        await page.locator('input[type=checkbox]').first().press('Enter')
        assert.deepEqual(await page.evaluate(() => (window as Seen).submitters), ['no-enter'])
        const [response] = await Promise.all([
          page.waitForResponse(
            (r) => r.request().method() === 'POST' && new URL(r.url()).pathname === '/auth/consent',
            { timeout: WAIT },
          ),
          passkey.click(),
        ])
        assert.equal(response.status(), 303, await describePage(page, seen))
        assert.match(response.request().postData() ?? '', /decision=approve/)
        await page.waitForURL((url) => url.origin === client.base && url.pathname === '/callback')
        assert.equal(await page.getByRole('heading').innerText(), 'Signed in', await describePage(page, seen))
        signCount = (await credentialsOf(authenticator))[0].signCount
      } finally {
        latch.passwordSignIn(true)
      }
    },
  )

  it(
    'asks for a sign-in again before adding a passkey after 15 minutes, which the passkey gives',
    { skip: SKIP },
    async () => {
      latch.advance(15 * 60)
      await page.goto(`${latch.issuer}/apps`)
      assert.equal(await heading(page), 'Connected apps', await describePage(page, seen))
      assert.equal(await page.locator('button', { hasText: 'Add a passkey' }).count(), 0) // by the DOM: hidden ones too
      await assertVisibleText(passkeysSection(page), 'To add a passkey, sign in again first')
      const response = await submit(
        page,
        passkeysSection(page).getByRole('button', { name: 'Sign in with a passkey' }),
        '/sign-in',
        seen,
      )
      assert.equal(response.status(), 303, await describePage(page, seen))
      await page.waitForURL(`${latch.issuer}/apps`)
      await page.getByRole('button', { name: 'Add a passkey' }).waitFor()
      assert.equal((await credentialsOf(authenticator))[0].signCount, ++signCount)
    },
  )

  it('offers no passkey in a browser without WebAuthn, where the password still works', { skip: SKIP }, async () => {
    const plain = await browser.newContext({ viewport: VIEWPORT })
    plain.setDefaultTimeout(WAIT)
    plain.setDefaultNavigationTimeout(WAIT)
    await plain.addInitScript(() => {
      delete (window as { PublicKeyCredential?: unknown }).PublicKeyCredential
    })
    try {
      const other = await plain.newPage()
      watch(other, 'no-webauthn', seen)
      await other.goto(`${latch.issuer}/apps`)
      assert.equal(await heading(other), 'Sign in')
      assert.equal(await other.evaluate(() => 'PublicKeyCredential' in window), false)
      // a passkey exists, so the page carries the button, but hidden
      const button = other.locator('button', { hasText: 'Sign in with a passkey' })
      assert.equal(await button.count(), 1)
      assert.equal(await button.evaluate((element) => (element as HTMLButtonElement).hidden), true)
      await signInWithPassword(other, latch, seen)
      await passkeysSection(other).waitFor()
      const add = other.locator('button', { hasText: 'Add a passkey' })
      assert.equal(await add.evaluate((element) => (element as HTMLButtonElement).hidden), true)
    } finally {
      await plain.close()
    }
  })

  it(
    'keeps the focus on the passkey button when the passkey fails, for a keyboard and a screen reader',
    { skip: SKIP },
    async () => {
      const failing = await browser.newContext({ viewport: VIEWPORT })
      failing.setDefaultTimeout(WAIT)
      try {
        const other = await failing.newPage()
        watch(other, 'failing', seen)
        // a device that holds no passkey of this site, and whose person is never verified: the ceremony fails
        const cdp = await failing.newCDPSession(other)
        await cdp.send('WebAuthn.enable')
        await cdp.send('WebAuthn.addVirtualAuthenticator', {
          options: {
            protocol: 'ctap2',
            transport: 'internal',
            hasResidentKey: true,
            hasUserVerification: true,
            isUserVerified: false,
            automaticPresenceSimulation: true,
          },
        })
        await other.goto(`${latch.issuer}/apps`)
        const button = passkeyButton(other)
        await button.focus()
        await other.keyboard.press('Enter')
        await other.getByRole('alert').filter({ hasText: 'The passkey did not work' }).waitFor()
        assert.equal(await button.evaluate((element) => element === element.ownerDocument.activeElement), true)
      } finally {
        await failing.close()
      }
    },
  )

  it('removes the passkey on /apps: the list no longer has it', { skip: SKIP }, async () => {
    // a second browser opens the sign-in page first, while the passkey exists, with the same key
    staleContext = await browser.newContext({ viewport: VIEWPORT })
    staleContext.setDefaultTimeout(WAIT)
    staleContext.setDefaultNavigationTimeout(WAIT)
    stalePage = await staleContext.newPage()
    watch(stalePage, 'second', seen)
    const second = await addAuthenticator(staleContext, stalePage)
    const [credential] = await credentialsOf(authenticator)
    await second.cdp.send('WebAuthn.addCredential', { authenticatorId: second.authenticatorId, credential })
    await stalePage.goto(`${latch.issuer}/apps`)
    await passkeyButton(stalePage).waitFor()

    await page.goto(`${latch.issuer}/apps`)
    if ((await heading(page)) === 'Sign in') await signInWithPassword(page, latch, seen)
    const section = passkeysSection(page)
    await assertVisibleText(section, PASSKEY_NAME)
    const response = await submit(page, section.getByRole('button', { name: 'Remove' }), '/passkeys/remove', seen)
    assert.equal(response.status(), 200, await describePage(page, seen))
    assert.equal(await heading(page), 'Connected apps')
    assert.match(await page.getByRole('status').innerText(), new RegExp(`^Removed the passkey ${PASSKEY_NAME}\\b`))
    assert.ok(!(await section.innerText()).includes(PASSKEY_NAME), await describePage(page, seen))
    assert.equal(await section.locator('button', { hasText: 'Remove' }).count(), 0)
    // the key stays on the authenticator: only Latch forgot it
    assert.equal((await credentialsOf(authenticator)).length, 1)
  })

  it('refuses the removed passkey: 401, an error on the page, and no session', { skip: SKIP }, async () => {
    const response = await submit(stalePage, passkeyButton(stalePage), '/sign-in', seen)
    assert.equal(response.status(), 401, await describePage(stalePage, seen))
    assert.equal(await heading(stalePage), 'Sign in')
    // refused for the key itself, not for a stale challenge or form
    const alert = await stalePage.getByRole('alert').innerText()
    assert.match(alert, /passkey/i)
    assert.doesNotMatch(alert, /challenge|csrf|form/i)
    const session = (await staleContext.cookies()).filter((cookie) => cookie.name === 'latch_session')
    assert.deepEqual(
      session.filter((cookie) => cookie.value !== ''),
      [],
    )
    // with no passkey left, the sign-in page has no passkey button, and so no script
    const again = await stalePage.goto(`${latch.issuer}/apps`)
    assert.equal(await heading(stalePage), 'Sign in')
    assert.equal(await stalePage.locator('button', { hasText: 'Sign in with a passkey' }).count(), 0)
    assert.equal(cspDirectives(again).has('script-src'), false)
    assert.deepEqual(cspDirectives(again).get('default-src'), ["'none'"])
  })

  it('adds a passkey when Enter is pressed in its name field, as the button does', { skip: SKIP }, async () => {
    await page.goto(`${latch.issuer}/apps`)
    const name = passkeysSection(page).locator('input[name=name]')
    await name.fill('Laptop')
    const [response] = await Promise.all([
      page.waitForResponse((r) => r.request().method() === 'POST' && new URL(r.url()).pathname === '/passkeys/add', {
        timeout: WAIT,
      }),
      name.press('Enter'),
    ])
    await page.waitForLoadState('load', { timeout: WAIT })
    assert.equal(response.status(), 200, await describePage(page, seen))
    assert.equal(await page.getByRole('status').innerText(), 'Added the passkey Laptop.')
  })

  it('breaks no Content-Security-Policy on the way', { skip: SKIP }, async () => {
    // the apps page carries the passkey button, and allows passkey.js and the challenge endpoint only
    const apps = await page.goto(`${latch.issuer}/apps`)
    assert.equal(await heading(page), 'Connected apps')
    assert.deepEqual(cspDirectives(apps).get('script-src'), [`${latch.issuer}/passkey.js`])
    assert.ok(cspDirectives(apps).get('connect-src')?.includes(`${latch.issuer}/passkeys/challenge`))
    assert.deepEqual(seen.csp, [], seen.errors.join('\n'))
  })
})
