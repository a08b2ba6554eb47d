// Latch for bench/attack.ts: the real handler and server (createHandler, createLatchServer) with
// an in-memory store, in a process of its own so that its memory is its own. Started by
// bench/attack.ts as `node --expose-gc --import tsx bench/attack-server.ts`, with an IPC channel.
//
// With ATTACK_SITE_PORT set, client discovery resolves every host name to ATTACK_PUBLIC_ADDRESS
// (93.184.215.14, a public-looking address, so that the address rules let it through) and an
// injected agent carries every connection to the local "hostile site" on 127.0.0.1 at that port:
// Latch itself never fetches loopback addresses. ATTACK_FETCH_TIMEOUT_MS sets the fetch deadline
// (unset: Latch's default).
//
// Messages, each answered with the same `id`:
//   { id, kind: 'usage', gc? }  memory (after two forced GCs when `gc`), CPU time, pending requests held, log lines
//   { id, kind: 'delay-reset' } starts the event-loop delay histogram afresh
//   { id, kind: 'delay' }       the histogram: max, p99 and mean delay in ms (resolution 1 ms)
// Once listening it sends { kind: 'ready', url }.

import { Agent } from 'node:http'
import { connect } from 'node:net'
import type { AddressInfo, Socket } from 'node:net'
import { monitorEventLoopDelay } from 'node:perf_hooks'
import { MemoryStore, createHandler, createLatchServer, loadConfig } from '../server.ts'
import type { ClientFetchOptions } from '../server.ts'

export type AttackMessage = { kind: 'usage'; gc?: boolean } | { kind: 'delay-reset' } | { kind: 'delay' }

export type AttackRequest = AttackMessage & { id: number }

export type AttackUsage = {
  rss: number
  heapUsed: number
  external: number
  cpuMicros: number
  /** Authorization requests the store holds, waiting for a decision. */
  pending: number
  logLines: number
  errorLines: number
  firstError: string | undefined
}

export type AttackDelay = { maxMs: number; p99Ms: number; meanMs: number; samples: number }

const SITE_PORT = Number(process.env.ATTACK_SITE_PORT ?? 0)
const PUBLIC_ADDRESS = process.env.ATTACK_PUBLIC_ADDRESS ?? '93.184.215.14'
const FETCH_TIMEOUT_MS =
  process.env.ATTACK_FETCH_TIMEOUT_MS === undefined ? undefined : Number(process.env.ATTACK_FETCH_TIMEOUT_MS)

/** An agent that takes every connection to the hostile site, whatever address Latch checked. */
class SiteAgent extends Agent {
  createConnection(): Socket {
    return connect(SITE_PORT, '127.0.0.1')
  }
}

const clientFetch: ClientFetchOptions | undefined =
  SITE_PORT === 0
    ? undefined
    : {
        lookup: async () => [{ address: PUBLIC_ADDRESS, family: 4 }],
        agent: new SiteAgent(),
        timeoutMs: FETCH_TIMEOUT_MS,
      }

let logLines = 0
let errorLines = 0
let firstError: string | undefined
const log = (line: string) => {
  logLines++
  if (/^error:|server_error| 5\d\d \d+ms$/.test(line)) {
    errorLines++
    firstError ??= line.slice(0, 300)
  }
}

const collect = (globalThis as { gc?: () => void }).gc
const delay = monitorEventLoopDelay({ resolution: 1 })
delay.enable()

const server = createLatchServer()
await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
const config = loadConfig({ PORT: '0', DATA_FILE: 'memory' }, [], { boundPort: (server.address() as AddressInfo).port })
const store = new MemoryStore({ log })
server.on('request', createHandler({ config, store, log, clientFetch }))

function usage(gc: boolean): AttackUsage {
  if (gc) {
    collect?.()
    collect?.()
  }
  const { rss, heapUsed, external } = process.memoryUsage()
  const { user, system } = process.cpuUsage()
  return {
    rss,
    heapUsed,
    external,
    cpuMicros: user + system,
    pending: store.pending.size,
    logLines,
    errorLines,
    firstError,
  }
}

process.on('message', (message: AttackRequest) => {
  if (message.kind === 'usage') return process.send?.({ id: message.id, ...usage(message.gc === true) })
  if (message.kind === 'delay-reset') {
    delay.reset()
    return process.send?.({ id: message.id })
  }
  const answer: AttackDelay = {
    maxMs: delay.max / 1e6,
    p99Ms: delay.percentile(99) / 1e6,
    meanMs: delay.mean / 1e6,
    samples: delay.count,
  }
  process.send?.({ id: message.id, ...answer })
})
process.on('disconnect', () => process.exit(0)) // the bench went away: so does this server

process.send?.({ kind: 'ready', url: `http://127.0.0.1:${(server.address() as AddressInfo).port}` })
