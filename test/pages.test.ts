// Page test: Debian's Chromium walks the pages Latch shows its owner and screenshots each one, at a
// phone's width and a desktop's, in light and in dark. The app is a discovered client, so the
// consent page and /apps show its name and logo: `notes.example` resolves, through an injected
// resolver, to a public-looking address, and an injected agent carries the connection to a local
// site server, as in discovery.test.ts. The walk: the consent page, an approval and a code
// exchanged with PKCE, a token for scripts, /apps, one Revoke, "Revoke all…", a passkey added with
// Chromium's virtual authenticator, the sign-in and consent pages that offer it, an error page, a
// sign-in locked after too many wrong passwords, and a 404. Each page is checked by what it says.
// Latch is loaded as http://localhost:PORT: WebAuthn refuses an IP address as the site's name.
//
// Without /usr/bin/chromium the tests are skipped with the reason printed; with CI set they fail.
// UPDATE_SCREENSHOTS=1 writes docs/screenshots/<page>-<phone|desktop>-<light|dark>.png.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { mkdir, writeFile } from 'node:fs/promises'
import { Agent } from 'node:http'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { connect } from 'node:net'
import type { Socket } from 'node:net'
import { deflateSync } from 'node:zlib'
import { SKIP, addAuthenticator, launchChromium } from './chromium.ts'
import { close, listen } from './harness.ts'
import type { Listening } from './harness.ts'
import type { Browser, BrowserContext, Locator, Page } from 'playwright-core'
import { createHandler, hashPassword, loadConfig } from '../server.ts'
import type { ClientFetchOptions } from '../server.ts'

// --- Harness ----------------------------------------------------------------------

const SCREENSHOTS = new URL('../docs/screenshots/', import.meta.url)
const WRITE_SCREENSHOTS = process.env.UPDATE_SCREENSHOTS === '1'

const PASSWORD = 'correct horse battery staple'
const ME = 'https://example.com/'
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk' // RFC 7636 Appendix B
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const CLIENT_ID = 'http://notes.example/'
const REDIRECT_URI = 'https://app.notes.example/callback'
const PUBLIC_ADDRESS = '93.184.215.14'
const NOW = Date.UTC(2027, 0, 1, 9, 30) // the server's clock, fixed, so the dates on the pages stay put

const WIDTHS = [
  ['phone', { width: 390, height: 844 }],
  ['desktop', { width: 1280, height: 800 }],
] as const
const SCHEMES = ['light', 'dark'] as const

/** The CRC-32 of PNG chunks (ISO 3309: the reflected polynomial 0xedb88320). */
function crc32(bytes: Buffer): number {
  let crc = 0xffffffff
  for (const byte of bytes) {
    crc ^= byte
    for (let bit = 0; bit < 8; bit++) crc = crc & 1 ? (crc >>> 1) ^ 0xedb88320 : crc >>> 1
  }
  return (crc ^ 0xffffffff) >>> 0
}

/** One PNG chunk: length, type, data and the CRC of type and data. */
function pngChunk(type: string, data: Buffer): Buffer {
  const body = Buffer.concat([Buffer.from(type, 'latin1'), data])
  const framed = Buffer.alloc(body.length + 8)
  framed.writeUInt32BE(data.length, 0)
  body.copy(framed, 4)
  framed.writeUInt32BE(crc32(body), body.length + 4)
  return framed
}

/** A 64×64 RGB PNG that looks like a notes app's logo: a white page with ruled lines on green. */
function makeLogo(): Buffer {
  const size = 64
  const green = [0x1e, 0x7a, 0x55]
  const white = [0xff, 0xff, 0xff]
  const stride = 1 + size * 3 // each row starts with its filter type, 0 (none)
  const pixels = Buffer.alloc(size * stride)
  for (let y = 0; y < size; y++) {
    for (let x = 0; x < size; x++) {
      const onPage = x >= 16 && x < 48 && y >= 10 && y < 54
      const ruled = x >= 21 && x < 43 && [20, 28, 36, 44].includes(y)
      pixels.set(onPage && !ruled ? white : green, y * stride + 1 + x * 3)
    }
  }
  const header = Buffer.alloc(13) // width, height, bit depth 8, colour type 2 (RGB), then three zeros
  header.writeUInt32BE(size, 0)
  header.writeUInt32BE(size, 4)
  header[8] = 8
  header[9] = 2
  return Buffer.concat([
    Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]),
    pngChunk('IHDR', header),
    pngChunk('IDAT', deflateSync(pixels)),
    pngChunk('IEND', Buffer.alloc(0)),
  ])
}

const LOGO = makeLogo()

/** The app's site, `notes.example`: a page with an h-app and its redirect URI, and the logo. */
function notesSite(req: IncomingMessage, res: ServerResponse): void {
  const cache = { 'Cache-Control': 'public, max-age=3600' } // so /apps still holds the logo
  if ((req.headers.host ?? '').split(':')[0] !== 'notes.example') {
    res.writeHead(404)
    return void res.end()
  }
  if (req.url === '/logo.png') {
    res.writeHead(200, { 'Content-Type': 'image/png', ...cache })
    return void res.end(LOGO)
  }
  res.writeHead(200, { 'Content-Type': 'text/html; charset=utf-8', ...cache })
  res.end(`<!doctype html><html lang="en"><head><title>Jot Notes</title>
<link rel="redirect_uri" href="${REDIRECT_URI}">
</head><body>
<div class="h-app"><img class="u-logo" src="/logo.png" alt=""><a class="u-url p-name" href="/">Jot Notes</a></div>
</body></html>`)
}

/** What client discovery is given: every name resolves to a public address, every connection reaches `site`. */
function clientFetchTo(site: Listening): ClientFetchOptions {
  const port = Number(new URL(site.base).port)
  class SiteAgent extends Agent {
    createConnection(): Socket {
      return connect(port, '127.0.0.1')
    }
  }
  return {
    lookup: async () => [{ address: PUBLIC_ADDRESS, family: 4 }],
    agent: new SiteAgent(),
    timeoutMs: 2000,
  }
}

/** Starts Latch on 127.0.0.1 and a free port, named localhost, with the owner's password set and a fixed clock. */
async function startLatch(clientFetch: ClientFetchOptions): Promise<Listening & { issuer: string }> {
  const env = {
    PORT: '0',
    HOST: 'localhost', // the name of the issuer: Latch itself listens on 127.0.0.1 here
    ME,
    DATA_FILE: 'memory',
    PASSWORD_HASH: await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 }),
  }
  let handler: (req: IncomingMessage, res: ServerResponse) => void = () => {}
  const latch = await listen((req, res) => handler(req, res))
  const config = loadConfig(env, [], { boundPort: Number(new URL(latch.base).port) })
  handler = createHandler({ config, log: () => {}, now: () => NOW, clientFetch })
  return { ...latch, base: config.issuer, issuer: config.issuer }
}

/** The authorization request of Jot Notes, with the challenge of RFC 7636 Appendix B. */
function authUrl(latch: Listening, redirectUri = REDIRECT_URI): string {
  const query = new URLSearchParams({
    response_type: 'code',
    client_id: CLIENT_ID,
    redirect_uri: redirectUri,
    state: 'jot-1',
    code_challenge: CHALLENGE,
    code_challenge_method: 'S256',
    scope: 'profile create',
    me: ME,
  })
  return `${latch.base}/auth?${query}`
}

/** What /introspect says of a token. */
async function introspect(latch: Listening, token: string): Promise<Record<string, unknown>> {
  const response = await fetch(`${latch.base}/introspect`, { method: 'POST', body: new URLSearchParams({ token }) })
  assert.equal(response.status, 200)
  return (await response.json()) as Record<string, unknown>
}

/** Whether the bytes are a PNG image: its eight-byte signature, and more than a header. */
function isPng(bytes: Buffer): boolean {
  return bytes.subarray(0, 8).equals(LOGO.subarray(0, 8)) && bytes.length > 1000
}

/**
 * What a page shows below WCAG 2.2 AA's contrast: a field's border against what is on either side
 * of it under 3:1 (1.4.11: the border is all that shows where a field is), a placeholder against
 * its field under 4.5:1 (1.4.3). Computed from the colours the browser resolved.
 */
const LOW_CONTRAST = `(() => {
  const rgba = (color) => { const [r, g, b, a = 1] = color.match(/[\\d.]+/g).map(Number); return { r, g, b, a } }
  const channel = (v) => (v / 255 <= 0.03928 ? v / 255 / 12.92 : ((v / 255 + 0.055) / 1.055) ** 2.4)
  const luminance = ({ r, g, b }) => 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)
  const ratio = (x, y) => { const [hi, lo] = [luminance(x), luminance(y)].sort((p, q) => q - p); return (hi + 0.05) / (lo + 0.05) }
  const behind = (element) => {
    for (let at = element.parentElement; at !== null; at = at.parentElement) {
      const color = rgba(getComputedStyle(at).backgroundColor)
      if (color.a > 0) return color
    }
    return rgba(getComputedStyle(document.documentElement).backgroundColor)
  }
  const found = []
  for (const field of document.querySelectorAll('input:not([type=hidden]):not([type=checkbox]):not([type=radio]), select')) {
    if (field.getClientRects().length === 0) continue
    const style = getComputedStyle(field)
    const around = behind(field)
    const fill = rgba(style.backgroundColor).a > 0 ? rgba(style.backgroundColor) : around
    const border = Math.min(ratio(rgba(style.borderTopColor), around), ratio(rgba(style.borderTopColor), fill))
    if (border < 3) found.push(field.name + ': border ' + border.toFixed(2) + ':1')
    if (field.placeholder) {
      const shown = ratio(rgba(getComputedStyle(field, '::placeholder').color), fill)
      if (shown < 4.5) found.push(field.name + ': placeholder ' + shown.toFixed(2) + ':1')
    }
  }
  return found
})()`

/**
 * The buttons of a row whose label cannot fit a word of it on one line, so that the browser breaks
 * it inside (WCAG 1.4.10 asks for no loss at 320 CSS pixels; "Appr|ove" is a loss).
 */
const BROKEN_WORDS = `(() => {
  const measure = document.createElement('canvas').getContext('2d')
  const found = []
  for (const button of document.querySelectorAll('.actions button')) {
    if (button.getClientRects().length === 0) continue
    const style = getComputedStyle(button)
    measure.font = style.fontWeight + ' ' + style.fontSize + ' ' + style.fontFamily
    const room = button.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight)
    for (const word of button.innerText.split(/\\s+/))
      if (measure.measureText(word).width > room + 0.5) found.push(word + ' in ' + Math.round(room) + ' px')
  }
  return found
})()`

/**
 * Screenshots the whole page at each width, in light and in dark, checking that nothing is wider
 * than the window, nor than a small phone's zoomed to 200% (160 CSS pixels, WCAG's reflow asks
 * 320), that no button's word is broken at 320, and that fields and placeholders stand out (see
 * `LOW_CONTRAST`); keeps them under docs/screenshots/ when asked to. Leaves the page light, at a
 * phone's width.
 */
async function capture(page: Page, name: string): Promise<void> {
  if (WRITE_SCREENSHOTS) await mkdir(SCREENSHOTS, { recursive: true })
  const sizes = [...WIDTHS, ['small', { width: 320, height: 640 }], ['zoomed', { width: 160, height: 600 }]] as const
  for (const [width, viewport] of sizes) {
    await page.setViewportSize(viewport)
    const scrollWidth = await page.evaluate<number>('document.documentElement.scrollWidth')
    assert.ok(scrollWidth <= viewport.width, `${name} is ${scrollWidth} px wide in a ${viewport.width} px window`)
    if (width === 'zoomed') continue
    if (width === 'small') {
      assert.deepEqual(await page.evaluate<string[]>(BROKEN_WORDS), [], `${name}: words broken at 320 px`)
      continue
    }
    for (const colorScheme of SCHEMES) {
      await page.emulateMedia({ colorScheme })
      assert.deepEqual(await page.evaluate<string[]>(LOW_CONTRAST), [], `${name} (${colorScheme}): low contrast`)
      const png = await page.screenshot({ fullPage: true, animations: 'disabled' }) // the buttons shown
      assert.ok(isPng(png), `screenshot ${name}-${width}-${colorScheme} is a PNG`)
      if (WRITE_SCREENSHOTS) await writeFile(new URL(`${name}-${width}-${colorScheme}.png`, SCREENSHOTS), png)
    }
  }
  await page.emulateMedia({ colorScheme: 'light' })
  await page.setViewportSize(WIDTHS[0][1])
}

/** Presses a button that posts a form and waits for the page its answer shows; returns that answer's status. */
async function press(page: Page, button: Locator): Promise<number> {
  const navigated = page.waitForEvent('framenavigated', (frame) => frame === page.mainFrame())
  const answered = page.waitForResponse(
    (response) =>
      response.request().isNavigationRequest() &&
      response.request().frame() === page.mainFrame() &&
      response.status() !== 303,
  )
  await button.click()
  const [response] = await Promise.all([answered, navigated])
  await page.waitForLoadState()
  return response.status()
}

/** The card of one app on /apps, found by the name in its heading. */
function appCard(page: Page, name: string): Locator {
  return page.locator('section.app').filter({ has: page.getByRole('heading', { level: 2, name, exact: true }) })
}

/** The width of the image a locator shows, as decoded: 0 when it could not be decoded. */
function naturalWidth(image: Locator): Promise<number> {
  return image.evaluate((element) => (element as unknown as { naturalWidth: number }).naturalWidth)
}

/** Asserts that the text shown inside the locator includes `text`. */
async function assertVisibleText(locator: Locator, text: string): Promise<void> {
  const shown = await locator.innerText()
  assert.ok(shown.includes(text), `expected the page to show ${text}, it shows:\n${shown}`)
}

// --- The walk ---------------------------------------------------------------------

describe("The owner's pages, at a phone's width and a desktop's, in light and dark", () => {
  let site: Listening
  let latch: Awaited<ReturnType<typeof startLatch>>
  let browser: Browser
  let context: BrowserContext
  let page: Page
  let appToken = ''
  const scriptTokens: string[] = []

  before(async () => {
    if (SKIP !== false) return
    site = await listen(notesSite)
    latch = await startLatch(clientFetchTo(site))
    browser = await launchChromium({ timeout: 10_000 })
    context = await browser.newContext({ viewport: WIDTHS[0][1], deviceScaleFactor: 1 })
    context.setDefaultTimeout(5000)
    page = await context.newPage()
    await addAuthenticator(context, page) // a device with a screen lock, as a phone is
  })

  after(async () => {
    await browser?.close()
    if (latch !== undefined) await close(latch)
    if (site !== undefined) await close(site)
  })

  it("consent: the discovered app's name and logo, the other host, a password field", { skip: SKIP }, async () => {
    const response = await page.goto(authUrl(latch))
    assert.equal(response?.status(), 200)
    await page.getByRole('heading', { level: 1, name: 'Sign in to Jot Notes', exact: true }).waitFor()
    const logo = page.locator('h1 img.logo')
    assert.match((await logo.getAttribute('src')) ?? '', /^data:image\/png;base64,/)
    assert.equal(await naturalWidth(logo), 64)
    const main = page.locator('main')
    await assertVisibleText(main, `The app Jot Notes at ${CLIENT_ID}`)
    await assertVisibleText(main, `wants to know that you are ${ME}`)
    assert.equal(await page.getByRole('link', { name: CLIENT_ID }).getAttribute('href'), CLIENT_ID)
    assert.equal(
      await page.locator('p.warning').innerText(),
      'After you decide, your browser goes to app.notes.example, not to notes.example: ' +
        'approve only if you expect that.',
    )
    assert.ok(await page.getByLabel('Password').isVisible())
    assert.equal(await page.getByRole('checkbox').count(), 2)
    await capture(page, 'consent')
  })

  it('approves with the password; the code is exchanged at /token with PKCE', { skip: SKIP }, async () => {
    // A route never sees where a redirect leads, and the app's host does not resolve: the consent
    // form's answer is fetched in the browser's cookie jar, and the browser shows the app's page.
    let location = ''
    await page.route(`${latch.base}/auth/consent`, async (route) => {
      const answer = await route.fetch({ maxRedirects: 0 })
      location = answer.headers().location ?? ''
      if (answer.status() !== 303) return route.fulfill({ response: answer })
      await route.fulfill({
        contentType: 'text/html; charset=utf-8',
        body: '<!doctype html><html lang="en"><title>Jot Notes</title><h1>Back at Jot Notes</h1></html>',
      })
    })
    await page.getByLabel('Password').fill(PASSWORD)
    assert.equal(await press(page, page.getByRole('button', { name: 'Approve' })), 200)
    await page.unroute(`${latch.base}/auth/consent`)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'Back at Jot Notes')
    const callback = new URL(location)
    assert.equal(`${callback.origin}${callback.pathname}`, REDIRECT_URI)
    assert.equal(callback.searchParams.get('state'), 'jot-1')
    assert.equal(callback.searchParams.get('iss'), latch.issuer)
    const exchanged = await fetch(`${latch.base}/token`, {
      method: 'POST',
      body: new URLSearchParams({
        grant_type: 'authorization_code',
        code: callback.searchParams.get('code') ?? '',
        client_id: CLIENT_ID,
        redirect_uri: REDIRECT_URI,
        code_verifier: VERIFIER,
      }),
    })
    const json = (await exchanged.json()) as { access_token?: string; me?: string; scope?: string }
    assert.equal(exchanged.status, 200, JSON.stringify(json))
    assert.equal(json.me, ME)
    assert.equal(json.scope, 'profile create')
    appToken = json.access_token ?? ''
    assert.equal((await introspect(latch, appToken)).client_id, CLIENT_ID)
  })

  it('script-token: makes a token for scripts on /apps and shows it once', { skip: SKIP }, async () => {
    for (const [name, scope, lifetime] of [
      ['Deploy notes', 'create update', '1 year'],
      ['Nightly backup', 'read', '1 month'],
    ]) {
      await page.goto(`${latch.base}/apps`)
      const maker = page.locator('section.maker')
      await maker.getByLabel('Name').fill(name)
      await maker.getByLabel('Scopes').fill(scope)
      await maker.getByLabel('Its access lasts').selectOption({ label: lifetime })
      // a token for a service is inactive to a Micropub endpoint, which names none: the field says so
      const service = maker.getByLabel('For the service at (optional)')
      const note = page.locator(`#${await service.getAttribute('aria-describedby')}`)
      assert.match(await note.innerText(), /Leave it empty for Micropub\./)
      assert.equal(await press(page, maker.getByRole('button', { name: 'Make a token' })), 200)
      assert.equal(new URL(page.url()).pathname, '/apps/tokens')
      await page.getByRole('heading', { level: 1, name: 'Your new token' }).waitFor()
      await assertVisibleText(page.locator('main'), `The token ${name} is ready`)
      const token = await page.locator('pre.token').innerText()
      assert.match(token, /^[A-Za-z0-9_-]{43}$/)
      await page.locator('pre.token').click()
      assert.equal(await page.evaluate('String(getSelection())'), token) // one click takes it whole
      await page.evaluate('getSelection().removeAllRanges()')
      const check = await introspect(latch, token)
      assert.equal(check.active, true)
      assert.equal(check.client_id, `${latch.issuer}/apps`)
      scriptTokens.push(token)
      if (scriptTokens.length === 1) await capture(page, 'script-token')
    }
  })

  it("apps: lists the discovered app with its logo, and the scripts' tokens", { skip: SKIP }, async () => {
    await page.goto(`${latch.base}/apps`)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'Connected apps')
    assert.equal(await page.locator('section.app').count(), 3)
    const jot = appCard(page, 'Jot Notes')
    const logo = jot.locator('h2 img.logo')
    assert.match((await logo.getAttribute('src')) ?? '', /^data:image\/png;base64,/)
    assert.equal(await naturalWidth(logo), 64)
    await assertVisibleText(jot, CLIENT_ID)
    await assertVisibleText(jot, 'profile create')
    const deploy = appCard(page, 'Deploy notes')
    await assertVisibleText(deploy, 'A token for scripts, made here')
    await assertVisibleText(deploy, 'create update')
    assert.equal(await deploy.locator('img').count(), 0)
    await page.getByRole('button', { name: 'Revoke all…' }).waitFor()
    await capture(page, 'apps')
  })

  it('apps-revoked: Revoke ends one token and says so', { skip: SKIP }, async () => {
    const deploy = appCard(page, 'Deploy notes')
    assert.equal(await press(page, deploy.getByRole('button', { name: 'Revoke Deploy notes', exact: true })), 200)
    assert.equal(new URL(page.url()).pathname, '/apps/revoke')
    assert.equal(await page.getByRole('status').innerText(), 'Revoked Deploy notes: its tokens stopped working.')
    assert.equal(await page.locator('section.app').count(), 2)
    assert.deepEqual(await introspect(latch, scriptTokens[0]), { active: false })
    assert.equal((await introspect(latch, appToken)).active, true)
    await capture(page, 'apps-revoked')
  })

  it('passkeys: adds a passkey named Phone, listed with when it was added', { skip: SKIP }, async () => {
    await page.goto(`${latch.base}/apps`)
    const section = page.locator('section.passkeys')
    await assertVisibleText(section, 'No passkey yet.')
    // a screen reader's list of the page's fields tells each from the others by its label alone
    const labels = await page.locator('label:visible').allInnerTexts()
    assert.deepEqual(labels, [...new Set(labels)])
    await section.getByLabel('Name').fill('Phone')
    assert.equal(await press(page, section.getByRole('button', { name: 'Add a passkey' })), 200)
    assert.equal(await page.getByRole('status').innerText(), 'Added the passkey Phone.')
    const phone = page.locator('div.passkey').filter({ has: page.getByRole('heading', { name: 'Phone' }) })
    await assertVisibleText(phone, 'Added\n2027-01-01 09:30 UTC')
    await assertVisibleText(phone, 'Last used\nNever')
    await phone.getByRole('button', { name: 'Remove' }).waitFor()
    await capture(page, 'passkeys')
  })

  it('sign-in-passkey: signed out, the sign-in page offers the passkey, which signs in', { skip: SKIP }, async () => {
    assert.equal(await press(page, page.locator('.bar').getByRole('button', { name: 'Sign out' })), 200)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'Sign in')
    const passkey = page.getByRole('button', { name: 'Sign in with a passkey' })
    await passkey.waitFor() // buttons show 0.6 s after the page
    await capture(page, 'sign-in-passkey')
    assert.equal(await press(page, passkey), 200)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'Connected apps')
    await assertVisibleText(page.locator('div.passkey'), 'Last used\n2027-01-01 09:30 UTC')
  })

  it('revoke-all: asks once more, naming the apps; yes revokes them all', { skip: SKIP }, async () => {
    assert.equal(await press(page, page.getByRole('button', { name: 'Revoke all…' })), 200)
    assert.equal(new URL(page.url()).pathname, '/apps/revoke-all')
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'Revoke all apps?')
    assert.deepEqual((await page.locator('main li').allInnerTexts()).sort(), ['Jot Notes', 'Nightly backup'])
    const yes = page.getByRole('button', { name: 'Yes, revoke all' })
    await yes.waitFor() // buttons show 0.6 s after the page
    assert.equal(await page.getByRole('link', { name: 'Back to your apps' }).count(), 1)
    assert.equal((await introspect(latch, appToken)).active, true) // nothing ends before the yes
    await capture(page, 'revoke-all')

    assert.equal(await press(page, yes), 200)
    assert.equal(await page.getByRole('status').innerText(), 'Revoked 2 apps: they have lost their access.')
    await page.getByText('No app holds a token right now.').waitFor()
    assert.deepEqual(await introspect(latch, appToken), { active: false })
    assert.deepEqual(await introspect(latch, scriptTokens[1]), { active: false })
  })

  it(
    'consent-passkey: signed out, the consent page offers the passkey beside the password',
    { skip: SKIP },
    async () => {
      const stranger = await browser.newContext({ viewport: WIDTHS[0][1], deviceScaleFactor: 1 })
      stranger.setDefaultTimeout(5000)
      try {
        const visitor = await stranger.newPage()
        assert.equal((await visitor.goto(authUrl(latch)))?.status(), 200)
        assert.ok(await visitor.getByLabel('Password').isVisible())
        await visitor.getByRole('button', { name: 'Approve with a passkey' }).waitFor() // shown 0.6 s after the page
        await capture(visitor, 'consent-passkey')
      } finally {
        await stranger.close()
      }
    },
  )

  it('error: a redirect_uri the app does not publish gets a page that says what to do', { skip: SKIP }, async () => {
    const response = await page.goto(authUrl(latch, 'https://elsewhere.example/callback'))
    assert.equal(response?.status(), 400)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'This sign-in cannot continue')
    await assertVisibleText(page.locator('main'), 'Go back to the app you came from and start again.')
    assert.equal(
      await page.locator('p.error').innerText(),
      'redirect_uri is not on the scheme, host and port of client_id, ' +
        `nor one of the redirect URIs the client publishes: ${REDIRECT_URI}`,
    )
    await assertVisibleText(page.locator('main'), 'Technical detail: invalid_request, HTTP 400')
    await capture(page, 'error')
  })

  it('lockout: the sign-in form after too many wrong passwords says how long to wait', { skip: SKIP }, async () => {
    const stranger = await browser.newContext({ viewport: WIDTHS[0][1], deviceScaleFactor: 1 })
    stranger.setDefaultTimeout(5000)
    try {
      const guesser = await stranger.newPage()
      await guesser.goto(`${latch.base}/apps`)
      assert.equal(await guesser.getByRole('heading', { level: 1 }).innerText(), 'Sign in')
      for (let attempt = 1; attempt <= 6; attempt++) {
        await guesser.getByLabel('Password').fill(`not the password ${attempt}`)
        assert.equal(
          await press(guesser, guesser.getByRole('button', { name: 'Sign in', exact: true })),
          401,
          `attempt ${attempt}`,
        )
        assert.equal(await guesser.getByRole('alert').innerText(), 'Wrong password')
      }
      await guesser.getByLabel('Password').fill(PASSWORD) // even the right one waits its turn
      assert.equal(await press(guesser, guesser.getByRole('button', { name: 'Sign in', exact: true })), 429)
      // the sixth wrong password was one past the five free: the next waits 2 seconds, on a clock that stands still
      assert.equal(await guesser.getByRole('alert').innerText(), 'Too many wrong passwords: try again in 2 seconds')
      assert.equal(await guesser.getByRole('heading', { level: 1 }).innerText(), 'Sign in')
      assert.equal(await guesser.getByLabel('Password').inputValue(), '')
      await capture(guesser, 'lockout')
    } finally {
      await stranger.close()
    }
  })

  it('not-found: an unknown path shows a browser a page, 404', { skip: SKIP }, async () => {
    const response = await page.goto(`${latch.base}/nowhere`)
    assert.equal(response?.status(), 404)
    assert.equal(await page.getByRole('heading', { level: 1 }).innerText(), 'There is nothing here')
    await assertVisibleText(page.locator('main'), 'Check the address, or start from the home page of this server.')
    await capture(page, 'not-found')
  })
})
