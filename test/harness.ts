// How the tests start Latch: in process, on 127.0.0.1 and a free port, with a clock the test
// moves by hand and the log kept in memory, where assertions can read it.

import { createServer } from 'node:http'
import { setTimeout as delay } from 'node:timers/promises'
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import { createHandler, createLatchServer, loadConfig } from '../server.ts'
import type { Store } from '../server.ts'

/** Where every test clock starts: a fixed instant, so that `exp` and `iat` can be asserted. */
export const START = Date.UTC(2027, 0, 1)

export type TestServer = {
  base: string
  port: number
  issuer: string
  logs: string[]
  /** Moves the server's clock, forward or (negative) back. */
  advance: (seconds: number) => void
  close: () => Promise<void>
}

/**
 * Starts Latch with the given settings (PORT is 0), and a store of the test's own if it passes
 * one; `maxHeaderSize` as an app that lets in larger headers than node:http's 16 KiB would. Its
 * handler is on a bare node:http server, as an app may put it, or with `latchServer` on the one
 * the command runs (`createLatchServer`: its timeouts and limits, its answers to unreadable bytes).
 */
export async function startLatch(
  env: Record<string, string> = {},
  options: { store?: Store; maxHeaderSize?: number; latchServer?: true } = {},
): Promise<TestServer> {
  const server = options.latchServer ? createLatchServer() : createServer({ maxHeaderSize: options.maxHeaderSize })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const port = (server.address() as AddressInfo).port
  const config = loadConfig({ PORT: '0', DATA_FILE: 'memory', ...env }, [], { boundPort: port })
  let time = START
  const logs: string[] = []
  // aborted at close: else each test's handler would go on sweeping its store, ten times a second, to the end of the run
  const stopped = new AbortController()
  const handler = createHandler({
    config,
    store: options.store,
    now: () => time,
    log: (line) => logs.push(line),
    signal: stopped.signal,
  })
  server.on('request', handler)
  return {
    base: `http://127.0.0.1:${port}`,
    port,
    issuer: config.issuer,
    logs,
    advance: (seconds) => {
      time += seconds * 1000
    },
    close: () => {
      stopped.abort()
      server.closeAllConnections()
      return new Promise((resolve) => server.close(() => resolve()))
    },
  }
}

/** A server of a test's own (a client app, a site), listening on 127.0.0.1 and a free port. */
export type Listening = { server: Server; base: string }

export async function listen(handler: (req: IncomingMessage, res: ServerResponse) => void): Promise<Listening> {
  const server = createServer(handler)
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return { server, base: `http://127.0.0.1:${(server.address() as AddressInfo).port}` }
}

export function close({ server }: Listening): Promise<void> {
  server.closeAllConnections()
  return new Promise((resolve) => server.close(() => resolve()))
}

/** Polls a condition every few milliseconds for at most `ms`; says whether it came true. */
export async function until(condition: () => boolean, ms = 5_000): Promise<boolean> {
  const deadline = performance.now() + ms
  while (!condition()) {
    if (performance.now() > deadline) return false
    await delay(5)
  }
  return true
}
