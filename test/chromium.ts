// How the browser tests start Debian's Chromium through playwright-core: never a downloaded
// browser. Without Chromium they are skipped with the reason printed; under CI they fail.

import { existsSync } from 'node:fs'
import { chromium } from 'playwright-core'
import type { Browser, BrowserContext, CDPSession, Page } from 'playwright-core'

const CHROMIUM = '/usr/bin/chromium'

/** Why Chromium cannot run, or undefined when it can. */
export const MISSING = existsSync(CHROMIUM)
  ? undefined
  : `Chromium not found at ${CHROMIUM}: apt-get install -y chromium to run the browser tests`

/** The `skip` option of a browser test: the reason, outside CI, when Chromium is missing. */
export const SKIP = MISSING !== undefined && (process.env.CI ?? '') === '' ? MISSING : false

/** Starts Chromium headless, with nothing that reaches out to the network; under CI, fails when it is missing. */
export function launchChromium(options: { timeout?: number } = {}): Promise<Browser> {
  if (MISSING !== undefined) throw new Error(`${MISSING} (CI is set, so the browser tests must run)`)
  return chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    ...options,
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-background-networking',
      '--disable-quic',
      '--no-first-run',
      '--disable-component-update',
      '--disable-sync',
    ],
  })
}

/** A virtual authenticator of the DevTools protocol, standing in for a phone or a laptop's screen lock. */
export type Authenticator = { cdp: CDPSession; authenticatorId: string }

/**
 * Gives a page a virtual platform authenticator (ctap2, internal): it keeps passkeys on the device
 * (resident keys), verifies the person, and finds them present at once.
 */
export async function addAuthenticator(context: BrowserContext, page: Page): Promise<Authenticator> {
  const cdp = await context.newCDPSession(page)
  await cdp.send('WebAuthn.enable')
  const { authenticatorId } = await cdp.send('WebAuthn.addVirtualAuthenticator', {
    options: {
      protocol: 'ctap2',
      transport: 'internal',
      hasResidentKey: true,
      hasUserVerification: true,
      isUserVerified: true,
      automaticPresenceSimulation: true,
    },
  })
  return { cdp, authenticatorId }
}
