// Remote-like: Latch as a client across a network meets it. Latch runs in a network namespace of
// its own, reached over a veth pair through a small proxy that holds every chunk DELAY_MS (1) each
// way, so that requests arrive spread out as they do from another machine, not in the bursts a
// local load generator sends. Introspection of an unknown token is the request: an answer written
// by `sendJson`, as the token path's are. Three patterns, each server CPU per request (all
// threads): one client one request at a time; ten clients one at a time each; 1,000 a second.
//
// `npm run bench:remote` (root: `ip netns`, `ip link`). REMOTE_SERVERS compares checkouts,
// `name=directory,name=directory` (default `Latch=.`): for instance the working tree beside a
// worktree that writes its answers in a `setImmediate`. REMOTE_ROUNDS (3) rounds, medians shown.

import { execFileSync, spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { connect, createServer } from 'node:net'
import { resolve } from 'node:path'
import { hashPassword } from '../server.ts'
import { atRate, oneAtATime } from './paced.ts'

const NAMESPACE = 'latch-bench'
const [HOST_SIDE, LATCH_SIDE] = ['10.77.0.1', '10.77.0.2']
const LATCH_PORT = 3900
const PROXY_PORT = 4000
const DELAY_MS = Number(process.env.DELAY_MS ?? 1)
const ROUNDS = Number(process.env.REMOTE_ROUNDS ?? 3)
const SERVERS = (process.env.REMOTE_SERVERS ?? 'Latch=.')
  .split(',')
  .map((entry) => entry.split('=') as [string, string])

/** The namespace and its veth pair, made afresh; `ip` fails loudly when this user may not. */
function makeNamespace(): void {
  const ip = (...args: string[]) => execFileSync('ip', args, { stdio: 'inherit' })
  removeNamespace()
  ip('netns', 'add', NAMESPACE)
  ip('link', 'add', 'latch-host', 'type', 'veth', 'peer', 'name', 'latch-ns')
  ip('link', 'set', 'latch-ns', 'netns', NAMESPACE)
  ip('addr', 'add', `${HOST_SIDE}/24`, 'dev', 'latch-host')
  ip('link', 'set', 'latch-host', 'up')
  ip('netns', 'exec', NAMESPACE, 'ip', 'addr', 'add', `${LATCH_SIDE}/24`, 'dev', 'latch-ns')
  ip('netns', 'exec', NAMESPACE, 'ip', 'link', 'set', 'latch-ns', 'up')
  ip('netns', 'exec', NAMESPACE, 'ip', 'link', 'set', 'lo', 'up')
}

/** Removes the namespace, and with it the veth pair; there may be none yet. */
function removeNamespace(): void {
  try {
    execFileSync('ip', ['netns', 'del', NAMESPACE], { stdio: 'ignore' })
  } catch {
    // none was there
  }
}

/** The network in between: each chunk, either way, is held DELAY_MS before it is passed on. */
function startDelayingProxy(): Promise<() => void> {
  const proxy = createServer((client) => {
    const latch = connect(LATCH_PORT, LATCH_SIDE)
    client.on('data', (chunk) => setTimeout(() => latch.write(chunk), DELAY_MS))
    latch.on('data', (chunk) => setTimeout(() => client.write(chunk), DELAY_MS))
    for (const [one, other] of [
      [client, latch],
      [latch, client],
    ]) {
      one.on('close', () => other.destroy())
      one.on('error', () => other.destroy())
    }
  })
  return new Promise((resolve) => proxy.listen(PROXY_PORT, HOST_SIDE, () => resolve(() => proxy.close())))
}

/** Starts a checkout's server.ts inside the namespace, with the bench's CPU probe preloaded. */
async function startLatch(directory: string, passwordHash: string): Promise<ChildProcess> {
  const probe = resolve('bench/probe.ts')
  const node = [process.execPath, '--import', 'tsx', '--import', probe, 'server.ts']
  const child = spawn('ip', ['netns', 'exec', NAMESPACE, ...node], {
    cwd: directory,
    env: {
      ...process.env,
      HOST: LATCH_SIDE,
      PORT: String(LATCH_PORT),
      DATA_FILE: 'memory',
      PASSWORD_HASH: passwordHash,
    },
    stdio: ['ignore', 'pipe', 'inherit', 'ipc'],
  })
  await new Promise<void>((ready, failed) => {
    child.stdout?.on('data', (chunk: Buffer) => chunk.toString().includes('listening') && ready())
    child.once('exit', (code) => failed(new Error(`server.ts in ${directory} exited ${code}`)))
  })
  child.stdout?.resume()
  return child
}

function cpuOf(child: ChildProcess): () => Promise<number> {
  return () =>
    new Promise((answer) => {
      child.once('message', (usage: { cpuMicros: number }) => answer(usage.cpuMicros))
      child.send('usage')
    })
}

const bodies = (from: number, count: number) =>
  Array.from({ length: count }, (_, i) => `token=unknown-${String(from + i).padStart(37, '0')}`)

const median = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]

makeNamespace()
const stopProxy = await startDelayingProxy()
const url = `http://${HOST_SIDE}:${PROXY_PORT}`
const passwordHash = await hashPassword('bench password', { ln: 10, r: 8, p: 1 })
const figures = new Map<string, number[]>()
const keep = (name: string, value: number) => figures.set(name, [...(figures.get(name) ?? []), value])
try {
  console.log(`Latch remote-like bench: through veth and a proxy holding each chunk ${DELAY_MS} ms each way`)
  for (let round = 0; round < ROUNDS; round++) {
    for (const [name, directory] of SERVERS) {
      const latch = await startLatch(directory, passwordHash)
      const cpu = cpuOf(latch)
      try {
        await oneAtATime(url, '/introspect', bodies(0, 2000), cpu) // warm it up first
        keep(
          `${name}, one client one at a time`,
          (await oneAtATime(url, '/introspect', bodies(0, 1000), cpu)).whole.cpuMicrosPerRequest,
        )
        const before = await cpu()
        const none = async () => 0
        await Promise.all(
          Array.from({ length: 10 }, (_, c) => oneAtATime(url, '/introspect', bodies(c * 300, 300), none)),
        )
        keep(`${name}, ten clients one at a time`, ((await cpu()) - before) / 3000)
        keep(
          `${name}, 1,000 a second`,
          (await atRate(url, '/introspect', bodies(0, 3000), 1000, cpu)).cpuMicrosPerRequest,
        )
      } finally {
        latch.kill('SIGTERM')
        await new Promise((closed) => latch.once('close', closed))
      }
    }
  }
  for (const [figure, values] of figures) {
    const all = values.map((value) => value.toFixed(0)).join(', ')
    console.log(
      `  ${figure.padEnd(46)} ${median(values).toFixed(0).padStart(4)} µs CPU per request (median; rounds: ${all})`,
    )
  }
} finally {
  stopProxy()
  removeNamespace()
}
