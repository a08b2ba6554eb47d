// (d) heap bytes per live token, and (e) the longest event-loop stall while they all expire.
// Runs alone in its own process: node --expose-gc --import tsx bench/memory.ts
// Prints one JSON line: { tokens, bytesPerToken, fillSeconds, drainSeconds, drained, left, maxStallMs, longestSweepMs, ... }.

import { monitorEventLoopDelay } from 'node:perf_hooks'
import { addLiveToken, createTokenStore, heldEntries, sweepExpired } from './tokens.ts'

const TOKENS = Number(process.env.BENCH_TOKENS ?? 1_000_000)
const TTL_MS = 7 * 86400 * 1000
/** The server sweeps every 100 ms; the bench sweeps as often as this so that it finishes sooner. */
const SWEEP_INTERVAL_MS = 10
const DRAIN_LIMIT_MS = 30_000

const collect = (globalThis as { gc?: () => void }).gc
if (collect === undefined) throw new Error('run with node --expose-gc')

function heapUsedAfterGc(): number {
  collect?.()
  collect?.()
  return process.memoryUsage().heapUsed
}

async function main(): Promise<void> {
  const start = Date.UTC(2027, 0, 1)
  const before = heapUsedAfterGc()
  const store = createTokenStore()
  const fillStarted = performance.now()
  for (let i = 0; i < TOKENS; i++) await addLiveToken(store, i, start, TTL_MS)
  const fillSeconds = (performance.now() - fillStarted) / 1000
  const bytesPerToken = (heapUsedAfterGc() - before) / TOKENS

  // Every token expires at once: advance the clock past them and let the sweep do its work.
  const later = start + TTL_MS + 1
  const delay = monitorEventLoopDelay({ resolution: 1 })
  delay.enable()
  const drainStarted = performance.now()
  let longestSweepMs = 0
  await new Promise<void>((resolve) => {
    const timer = setInterval(() => {
      const sweepStarted = performance.now()
      sweepExpired(store, later)
      longestSweepMs = Math.max(longestSweepMs, performance.now() - sweepStarted)
      if (heldEntries(store) === 0 || performance.now() - drainStarted > DRAIN_LIMIT_MS) {
        clearInterval(timer)
        resolve()
      }
    }, SWEEP_INTERVAL_MS)
  })
  const drainSeconds = (performance.now() - drainStarted) / 1000
  await new Promise((resolve) => setTimeout(resolve, 200)) // a GC that the last deletes set off counts too
  delay.disable()
  const left = heldEntries(store)
  console.log(
    JSON.stringify({
      tokens: TOKENS,
      bytesPerToken,
      fillSeconds,
      drainSeconds,
      drained: left === 0,
      left,
      maxStallMs: delay.max / 1e6,
      longestSweepMs,
      sweepIntervalMs: SWEEP_INTERVAL_MS,
    }),
  )
}

await main()
