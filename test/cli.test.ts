// The command line and the log: what an operator reads. Start-up failures, --help, hash-password
// and the start-up block run `node --import tsx server.ts` as a child process; the log lines of
// requests and security events come from Latch in process, with the harness's clock and log.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, spawnSync } from 'node:child_process'
import type { ChildProcessWithoutNullStreams, SpawnOptions } from 'node:child_process'
import { EventEmitter } from 'node:events'
import { chmod, chown, mkdir, mkdtemp, readdir, rm, symlink, writeFile } from 'node:fs/promises'
import { existsSync, readFileSync } from 'node:fs'
import { request as httpRequest } from 'node:http'
import { connect } from 'node:net'
import { tmpdir } from 'node:os'
import { join, relative } from 'node:path'
import { fileURLToPath } from 'node:url'
import { SETTINGS, hashPassword, hashSecret, verifyPassword } from '../server.ts'
import { startLatch, until } from './harness.ts'
import type { TestServer } from './harness.ts'

/** The PKCE example of RFC 7636 Appendix B. */
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const FAST_COST = { ln: 10, r: 8, p: 1 }
const PASSWORD = 'correct horse'
const PASSWORD_HASH = await hashPassword(PASSWORD, FAST_COST)

/** The folder of server.ts, where the child runs. */
const ROOT = fileURLToPath(new URL('..', import.meta.url))
/** How long a child may take to start, answer or stop before the test gives up on it. */
const CHILD_TIMEOUT_MS = 20_000
/** A passkey record as the journal holds it: its key is never checked at start-up. */
const PASSKEY = { name: 'Phone', publicKey: 'MCowBQYDK2VwAyEA', algorithm: -8, counter: 0, addedAt: Date.now() }
const NOBODY = 65534

let directory: string
before(async () => {
  directory = await mkdtemp(join(tmpdir(), 'latch-cli-'))
  await chmod(directory, 0o755) // the unprivileged user of the permission cases walks through it
})
after(() => rm(directory, { recursive: true, force: true }))

// --- Running the command line ------------------------------------------------------------

/** The test's environment without any Latch setting, plus the case's own. */
function childEnv(settings: Record<string, string>): Record<string, string> {
  const env: Record<string, string> = {}
  const names = new Set<string>(SETTINGS.map((setting) => setting.name))
  for (const [name, value] of Object.entries(process.env)) {
    if (value !== undefined && !names.has(name) && !name.startsWith('NODE_TEST')) env[name] = value
  }
  return { ...env, ...settings }
}

type Exit = { code: number | null; stdout: string; stderr: string }

/**
 * Runs the command line to its end. A server that starts listening instead of failing is stopped
 * at once, and answers `code: null`; so is one that runs past the timeout.
 */
function runLatch(
  args: string[],
  settings: Record<string, string>,
  options: { input?: string | Buffer; as?: number } = {},
): Promise<Exit> {
  return new Promise((resolve, reject) => {
    const spawnOptions: SpawnOptions = { cwd: ROOT, env: childEnv(settings) }
    if (options.as !== undefined) Object.assign(spawnOptions, { uid: options.as, gid: options.as })
    const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts', ...args], spawnOptions)
    let stdout = ''
    let stderr = ''
    const timer = setTimeout(() => child.kill('SIGKILL'), CHILD_TIMEOUT_MS)
    child.stdout?.setEncoding('utf8').on('data', (chunk: string) => {
      stdout += chunk
      if (stdout.includes('Latch is listening')) child.kill('SIGKILL')
    })
    child.stderr?.setEncoding('utf8').on('data', (chunk: string) => (stderr += chunk))
    child.on('error', reject)
    child.on('close', (code) => {
      clearTimeout(timer)
      resolve({ code, stdout, stderr })
    })
    child.stdin?.end(options.input ?? '')
  })
}

/** A failure at start-up: exit 1, one line on stderr that starts `latch: `, and no stack trace. */
function assertOneLineFailure(result: Exit, expected: RegExp): void {
  const output = `stdout:\n${result.stdout}\nstderr:\n${result.stderr}`
  assert.equal(result.code, 1, output)
  const lines = result.stderr.split('\n').filter((line) => line.trim() !== '')
  assert.equal(lines.length, 1, output)
  assert.match(lines[0], /^latch: /)
  assert.match(lines[0], expected)
  assert.doesNotMatch(result.stderr, /\n\s+at |Error:/)
}

type Running = {
  child: ChildProcessWithoutNullStreams
  lines: string[]
  /** The first line of stdout that passes the test, waited for up to the timeout. */
  waitForLine: (test: (line: string) => boolean, what: string) => Promise<string>
  stop: () => Promise<void>
}

/** Starts the server as a child process and reads its stdout line by line. */
function serve(settings: Record<string, string>): Running {
  const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts'], { cwd: ROOT, env: childEnv(settings) })
  const lines: string[] = []
  const events = new EventEmitter()
  let pending = ''
  let stderr = ''
  let exited = false
  child.stdout.setEncoding('utf8').on('data', (chunk: string) => {
    const parts = (pending + chunk).split('\n')
    pending = parts.pop() ?? ''
    lines.push(...parts)
    events.emit('line')
  })
  child.stderr.setEncoding('utf8').on('data', (chunk: string) => (stderr += chunk))
  const closed = new Promise<void>((resolve) =>
    child.on('close', () => {
      exited = true
      events.emit('line')
      resolve()
    }),
  )
  const waitForLine = (test: (line: string) => boolean, what: string) =>
    new Promise<string>((resolve, reject) => {
      const output = () => `stdout:\n${lines.join('\n')}${pending}\nstderr:\n${stderr}`
      const check = () => {
        const line = lines.find(test)
        if (line !== undefined) {
          done()
          resolve(line)
        } else if (exited) {
          done()
          reject(new Error(`the server exited before ${what}\n${output()}`))
        }
      }
      const timer = setTimeout(() => {
        done()
        reject(new Error(`no ${what} within ${CHILD_TIMEOUT_MS} ms\n${output()}`))
      }, CHILD_TIMEOUT_MS)
      const done = () => {
        clearTimeout(timer)
        events.off('line', check)
      }
      events.on('line', check)
      check()
    })
  const stop = async () => {
    if (exited) return
    const timer = setTimeout(() => child.kill('SIGKILL'), CHILD_TIMEOUT_MS)
    child.kill('SIGTERM')
    await closed
    clearTimeout(timer)
  }
  return { child, lines, waitForLine, stop }
}

/** Why the unprivileged cases cannot run here, or undefined when they can; `as` is the user to run them as. */
function unprivilegedUser(): { as?: number; skip?: string } {
  if (process.getuid === undefined) return { skip: 'this platform has no Unix users' }
  if (process.getuid() !== 0) return {} // the test's own user is unprivileged already
  const probe = spawnSync(process.execPath, ['--import', 'tsx', 'server.ts', '--help'], {
    cwd: ROOT,
    env: childEnv({}),
    uid: NOBODY,
    gid: NOBODY,
    encoding: 'utf8',
    timeout: CHILD_TIMEOUT_MS,
  })
  if (probe.error !== undefined || probe.status !== 0) {
    const why = probe.error?.message ?? probe.stderr.split('\n')[0]
    return { skip: `running as root, and uid ${NOBODY} cannot run server.ts from ${ROOT}: ${why}` }
  }
  return { as: NOBODY }
}

/** The lowest port an unprivileged user may bind, as Linux says; 1024 elsewhere. */
function unprivilegedPortStart(): number {
  try {
    return Number(readFileSync('/proc/sys/net/ipv4/ip_unprivileged_port_start', 'utf8').trim())
  } catch {
    return 1024
  }
}

// --- Start-up failures -------------------------------------------------------------------

describe('A start-up failure is one line naming the setting and the fix, and exit 1', () => {
  it('DATA_FILE that is a symbolic link, through another, into a folder that does not exist', async () => {
    // relative targets, as `ln -s` often makes them: each is read from its own link's folder
    await mkdir(join(directory, 'links'), { recursive: true })
    await symlink('../no-such-folder/latch.jsonl', join(directory, 'links', 'hop.jsonl'))
    const link = join(directory, 'dangling.jsonl')
    await symlink('links/hop.jsonl', link)
    const result = await runLatch([], { DATA_FILE: link, PORT: '0' })
    const missing = join(directory, 'no-such-folder')
    assertOneLineFailure(
      result,
      new RegExp(
        `DATA_FILE .*dangling\\.jsonl is a symbolic link to ${missing}/latch\\.jsonl, whose folder does not exist: create ${missing}, or point the link elsewhere`,
      ),
    )
  })

  it('DATA_FILE that is a directory', async () => {
    const folder = join(directory, 'a-folder')
    await mkdir(folder)
    const result = await runLatch([], { DATA_FILE: folder, PORT: '0' })
    assertOneLineFailure(result, /DATA_FILE .*a-folder is a directory: name a file in it, as in DATA_FILE=.*\.jsonl/)
  })

  it('DATA_FILE inside a file', async () => {
    const file = join(directory, 'a-file')
    await writeFile(file, '')
    const result = await runLatch([], { DATA_FILE: join(file, 'x.jsonl'), PORT: '0' })
    assertOneLineFailure(result, /DATA_FILE .*a-file\/x\.jsonl is inside a file, not a folder: choose a path/)
  })

  it('DATA_FILE in a folder that cannot be made under one that exists', async () => {
    // /proc refuses a new folder with ENOENT, on which node's recursive mkdir tries again for ever
    const result = await runLatch([], { DATA_FILE: '/proc/no-such-folder/latch.jsonl', PORT: '0' })
    assertOneLineFailure(result, /DATA_FILE \/proc\/no-such-folder\/latch\.jsonl has a folder that cannot be created/)
  })

  it('DATA_FILE given relative to the working folder: the message says where that is', async () => {
    const result = await runLatch([], { DATA_FILE: relative(ROOT, '/proc/no-such-folder/latch.jsonl'), PORT: '0' })
    assertOneLineFailure(
      result,
      /DATA_FILE \.\.\/\S+ \(\/proc\/no-such-folder\/latch\.jsonl\) has a folder that cannot/,
    )
  })

  it('DATA_FILE in a folder the user cannot write', async (t) => {
    const user = unprivilegedUser()
    if (user.skip !== undefined) return void t.skip(user.skip)
    const folder = join(directory, 'read-only')
    await mkdir(folder, { mode: 0o555 })
    await chmod(folder, 0o555) // whatever the umask
    const result = await runLatch([], { DATA_FILE: join(folder, 'latch.jsonl'), PORT: '0' }, { as: user.as })
    assertOneLineFailure(result, /DATA_FILE .*read-only\/latch\.jsonl cannot be read or written by this user: give/)
  })

  it('DATA_FILE put back by root in the folder of the user, without its chown: names the fix', async (t) => {
    const user = unprivilegedUser()
    if (user.skip !== undefined) return void t.skip(user.skip)
    if (process.getuid?.() !== 0) return void t.skip('only root can give the folder to the unprivileged user')
    const folder = join(directory, 'restored')
    await mkdir(folder, { mode: 0o700 })
    await chown(folder, NOBODY, NOBODY)
    const file = join(folder, 'latch.jsonl')
    await writeFile(file, '', { mode: 0o600 }) // root's, as `install -m 600` leaves a restored copy
    const result = await runLatch([], { DATA_FILE: file, PORT: '0' }, { as: user.as })
    assertOneLineFailure(
      result,
      new RegExp(`DATA_FILE .*restored/latch\\.jsonl belongs to another user \\(uid 0\\), .*: .*chown ${NOBODY} `),
    )
  })

  it('DATA_FILE below a folder this user may not enter: names the folder, not the length of the path', async (t) => {
    const user = unprivilegedUser()
    if (user.skip !== undefined) return void t.skip(user.skip)
    if (user.as === undefined) return void t.skip('needs root, to make a folder this user may not enter')
    const locked = join(directory, 'locked')
    await mkdir(locked, { mode: 0o700 }) // root's
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: join(locked, 'sub', 'latch.jsonl'), PORT: '0' }, { as: user.as }),
      /cannot be read or written by this user: give the user its folder, or choose a path it owns$/,
    )
  })

  it('DATA_FILE of its own that its mode keeps it from writing: names chmod, not the folder', async (t) => {
    const user = unprivilegedUser() // root writes any file, whatever its mode
    if (user.skip !== undefined) return void t.skip(user.skip)
    const folder = join(directory, 'own-read-only')
    await mkdir(folder, { mode: 0o700 })
    const file = join(folder, 'latch.jsonl')
    await writeFile(file, '', { mode: 0o400 }) // as `install -m 400` or `chmod a-w` leave it
    if (user.as !== undefined) {
      await chown(folder, user.as, user.as)
      await chown(file, user.as, user.as)
    }
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: file, PORT: '0' }, { as: user.as }),
      /own-read-only\/latch\.jsonl is not writable by its owner, this user \(mode 0400\): run chmod 600 \S+$/,
    )
    await chmod(file, 0o000)
    const failed = await runLatch([], { DATA_FILE: relative(ROOT, file), PORT: '0' }, { as: user.as })
    assertOneLineFailure(failed, /latch\.jsonl\) is not readable or writable by its owner, this user \(mode 0000\)/)
    assert.ok(failed.stderr.trim().endsWith(`: run chmod 600 ${file}`), failed.stderr) // given relative, named whole
    await chmod(file, 0o600)
    assert.match((await runLatch([], { DATA_FILE: file, PORT: '0' }, { as: user.as })).stdout, /Latch is listening/)
  })

  it('DATA_FILE of its own in a folder the user cannot write, where compaction could never replace it', async (t) => {
    const user = unprivilegedUser()
    if (user.skip !== undefined) return void t.skip(user.skip)
    if (process.getuid?.() !== 0) return void t.skip('only root can give the file to the unprivileged user')
    const folder = join(directory, 'roots')
    await mkdir(folder, { mode: 0o755 })
    const file = join(folder, 'latch.jsonl')
    await writeFile(file, '', { mode: 0o600 })
    await chown(file, NOBODY, NOBODY)
    const result = await runLatch([], { DATA_FILE: file, PORT: '0' }, { as: user.as })
    assertOneLineFailure(
      result,
      /DATA_FILE .*roots\/latch\.jsonl is in a folder this user cannot write \(.*roots\), where the journal is rewritten as it grows: give the user the folder/,
    )
  })

  it("DATA_FILE in a folder of the user's own that its mode keeps it from using: names chmod, which then works", async (t) => {
    const user = unprivilegedUser() // root uses any folder, whatever its mode
    if (user.skip !== undefined) return void t.skip(user.skip)
    const folder = join(directory, 'own-folder-locked')
    await mkdir(folder, { mode: 0o700 })
    if (user.as !== undefined) await chown(folder, user.as, user.as)
    const start = (path: string) => runLatch([], { DATA_FILE: join(folder, path), PORT: '0' }, { as: user.as })
    const fix = (mode: string) =>
      new RegExp(
        `is in a folder of this user's that its mode keeps it from using \\(\\S+own-folder-locked, mode ${mode}\\), ` +
          'where the journal is made and rewritten as it grows: run chmod u\\+rwx \\S+own-folder-locked$',
      )
    // as a chmod u-w, u-r or u-x leaves it: for a new file, and one in a folder it cannot make there
    for (const mode of [0o500, 0o300, 0o600]) {
      await chmod(folder, mode)
      const shown = mode.toString(8).padStart(4, '0')
      assertOneLineFailure(await start('latch.jsonl'), fix(shown))
      if (mode !== 0o300) assertOneLineFailure(await start('sub/latch.jsonl'), fix(shown)) // 0300 makes sub/ itself
      await chmod(folder, 0o700)
      assert.deepEqual(await readdir(folder), []) // nothing is left of a refused start
    }
    await writeFile(join(folder, 'latch.jsonl'), '', { mode: 0o600 })
    if (user.as !== undefined) await chown(join(folder, 'latch.jsonl'), user.as, user.as)
    await chmod(folder, 0o500)
    assertOneLineFailure(await start('latch.jsonl'), fix('0500'))
    await chmod(folder, 0o700) // the fix named
    assert.match((await start('latch.jsonl')).stdout, /Latch is listening/)
  })

  it('DATA_FILE that other users may write, or that is in a folder they may write', async () => {
    const folder = join(directory, 'shared')
    await mkdir(folder)
    const file = join(folder, 'latch.jsonl')
    await writeFile(file, '')
    await chmod(file, 0o666)
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: file, PORT: '0' }),
      /DATA_FILE .*shared\/latch\.jsonl can be written by other users \(mode 0666\), who could write tokens into it: run chmod 600 .*shared\/latch\.jsonl$/,
    )
    await chmod(file, 0o644) // readable is no danger: it holds hashes of tokens, not tokens
    await chmod(folder, 0o777)
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: file, PORT: '0' }),
      /DATA_FILE .*shared\/latch\.jsonl has on its path a folder other users can write to \(.*shared, mode 0777\), who could put another file in its place: run chmod go-w .*shared, or choose another folder$/,
    )
    await chmod(folder, 0o1777) // as /tmp: others may not rename or delete what is not theirs
    assert.match((await runLatch([], { DATA_FILE: file, PORT: '0' })).stdout, /Latch is listening/)
  })

  it('DATA_FILE its group may write is refused; in a folder its group may write it starts; below or linked from a folder others may write it is refused', async () => {
    const own = join(directory, 'own-group')
    await mkdir(own)
    await chmod(own, 0o775) // a umask of 002, as systems that give each user a group of their own set
    const file = join(own, 'latch.jsonl')
    await writeFile(file, '')
    await chmod(file, 0o664) // the file itself, made 0600 by Latch, is its owner's alone
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: file, PORT: '0' }),
      /own-group\/latch\.jsonl can be written by other users \(mode 0664\)/,
    )
    await chmod(file, 0o644)
    assert.match((await runLatch([], { DATA_FILE: file, PORT: '0' })).stdout, /Latch is listening/)
    if (process.getuid?.() === 0) {
      await chown(own, 0, NOBODY) // the same mode, for a group of others
      assertOneLineFailure(
        await runLatch([], { DATA_FILE: file, PORT: '0' }),
        /own-group\/latch\.jsonl has on its path a folder other users can write to \(.*own-group, mode 0775\)/,
      )
      await chown(own, 0, 0)
    }
    const open = join(directory, 'open')
    await mkdir(join(open, 'private'), { recursive: true })
    await chmod(open, 0o777)
    await chmod(join(open, 'private'), 0o700)
    const below = join(open, 'private', 'latch.jsonl')
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: below, PORT: '0' }),
      /private\/latch\.jsonl has on its path a folder other users can write to \(.*\/open, mode 0777\)/,
    )
    assert.equal(existsSync(below), false) // a refused start leaves no file behind
    const link = join(open, 'link.jsonl')
    await symlink(file, link) // another user could point it at an old copy of the journal
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: link, PORT: '0' }),
      /own-group\/latch\.jsonl has on its path a folder other users can write to \(.*\/open, mode 0777\)/,
    )
  })

  it('DATA_FILE that belongs to another user', async (t) => {
    if (process.getuid?.() !== 0) return void t.skip('only root can give a file to another user')
    const file = join(directory, 'theirs.jsonl')
    await writeFile(file, '')
    await chown(file, NOBODY, NOBODY)
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: file, PORT: '0' }),
      new RegExp(
        `DATA_FILE .*theirs\\.jsonl belongs to another user \\(uid ${NOBODY}\\), who could write tokens into it: ` +
          'run Latch as that user, or give the file to this one \\(uid 0\\) with chown$',
      ),
    )
  })

  it('DATA_FILE below a folder of another user, who could rename it away', async (t) => {
    if (process.getuid?.() !== 0) return void t.skip('only root can give a folder to another user')
    const theirs = join(directory, 'theirs')
    await mkdir(join(theirs, 'mine'), { recursive: true })
    await chown(theirs, NOBODY, NOBODY)
    await chmod(theirs, 0o755) // not writable by others: only its owner could move what is in it
    await chmod(join(theirs, 'mine'), 0o700)
    assertOneLineFailure(
      await runLatch([], { DATA_FILE: join(theirs, 'mine', 'latch.jsonl'), PORT: '0' }),
      new RegExp(`latch\\.jsonl has on its path a folder of another user \\(.*/theirs, uid ${NOBODY}\\)`),
    )
  })

  it('HOST with an interface, which a URL cannot carry, and a link-local one without', async () => {
    const zoned = await runLatch([], { HOST: 'fe80::1%lo', PASSWORD_HASH, DATA_FILE: 'memory', PORT: '0' })
    assertOneLineFailure(zoned, /HOST fe80::1%lo names an interface \(%lo\), which a URL cannot carry: use an address/)
    const linkLocal = await runLatch([], { HOST: 'fe80::1', PASSWORD_HASH, DATA_FILE: 'memory', PORT: '0' })
    assertOneLineFailure(
      linkLocal,
      /HOST fe80::1 cannot be listened on without naming an interface .*: use 127\.0\.0\.1/,
    )
  })

  it('DATA_FILE whose name is longer than the file system allows', async () => {
    const file = join(directory, `${'a'.repeat(300)}.jsonl`)
    const result = await runLatch([], { DATA_FILE: file, PORT: '0' })
    assertOneLineFailure(
      result,
      /DATA_FILE .*a\.jsonl is a path longer than the file system allows: choose a shorter one/,
    )
  })

  it('DATA_FILE marked immutable, which not even its owner may write', async (t) => {
    const file = join(directory, 'immutable.jsonl')
    await writeFile(file, '')
    const marked = spawnSync('chattr', ['+i', file], { encoding: 'utf8' })
    if (marked.status !== 0) return void t.skip(`chattr +i is not possible here: ${marked.stderr || marked.error}`)
    try {
      assertOneLineFailure(
        await runLatch([], { DATA_FILE: file, PORT: '0' }),
        /immutable\.jsonl cannot be written, even by its owner: it may be marked immutable \(lsattr shows an i; chattr -i/,
      )
    } finally {
      spawnSync('chattr', ['-i', file])
    }
  })

  it('HOST that does not resolve', async () => {
    const result = await runLatch([], {
      HOST: 'nonexistent.invalid',
      PASSWORD_HASH,
      DATA_FILE: 'memory',
      PORT: '0',
    })
    assertOneLineFailure(result, /HOST nonexistent\.invalid is not an address of this machine: use 127\.0\.0\.1/)
  })

  it('PORT 80 as a user who may not bind it', async (t) => {
    const user = unprivilegedUser()
    if (user.skip !== undefined) return void t.skip(user.skip)
    const start = unprivilegedPortStart()
    if (start <= 80) return void t.skip(`every user may bind port 80 here (ip_unprivileged_port_start is ${start})`)
    const result = await runLatch([], { PORT: '80', DATA_FILE: 'memory' }, { as: user.as })
    assertOneLineFailure(result, /PORT 80 may not be bound by this user.*: use a port such as 3000/)
  })

  it('LOG_FORMAT that is not a choice', async () => {
    const result = await runLatch([], { LOG_FORMAT: 'xml', DATA_FILE: 'memory', PORT: '0' })
    assertOneLineFailure(result, /LOG_FORMAT xml is not a choice: set it to json or text/)
  })

  it('TRUST_PROXY that is not an address', async () => {
    const result = await runLatch([], { TRUST_PROXY: 'not-an-ip', DATA_FILE: 'memory', PORT: '0' })
    assertOneLineFailure(result, /TRUST_PROXY not-an-ip is not an IP address or range: .*127\.0\.0\.1/)
  })

  it('PASSWORD_SIGN_IN=off while the data file holds no passkey', async () => {
    const settings = { PASSWORD_SIGN_IN: 'off', PASSWORD_HASH, ISSUER: 'http://localhost:3000', PORT: '0' }
    const result = await runLatch([], { ...settings, DATA_FILE: join(directory, 'no-passkeys.jsonl') })
    assertOneLineFailure(
      result,
      /PASSWORD_SIGN_IN=off, and .*no-passkeys\.jsonl holds no passkey, so no one could sign in: unset PASSWORD_SIGN_IN/,
    )
    assert.equal(existsSync(join(directory, 'no-passkeys.jsonl')), false) // not left behind, empty
    const empty = join(directory, 'empty.jsonl')
    await writeFile(empty, '')
    assertOneLineFailure(
      await runLatch([], { ...settings, DATA_FILE: empty }),
      /PASSWORD_SIGN_IN=off, and .*empty\.jsonl holds no passkey/,
    )
  })

  it('PASSWORD_SIGN_IN=off while every passkey was made for another host than ISSUER', async () => {
    const file = join(directory, 'other-host-passkeys.jsonl')
    await writeFile(
      file,
      `${JSON.stringify({ set: 'passkey', key: 'credential-1', value: { ...PASSKEY, rpId: 'old.example' } })}\n`,
    )
    const settings = { PASSWORD_SIGN_IN: 'off', PASSWORD_HASH, ISSUER: 'http://localhost:3000', PORT: '0' }
    const result = await runLatch([], { ...settings, DATA_FILE: file })
    assertOneLineFailure(
      result,
      /PASSWORD_SIGN_IN=off, and the 1 passkey in .*other-host-passkeys\.jsonl was made for old\.example, not localhost/,
    )
  })

  it('PASSWORD_SIGN_IN=off with DATA_FILE=memory, which keeps no passkey', async () => {
    const settings = { PASSWORD_SIGN_IN: 'off', PASSWORD_HASH, ISSUER: 'http://localhost:3000', PORT: '0' }
    const result = await runLatch([], { ...settings, DATA_FILE: 'memory' })
    assertOneLineFailure(result, /DATA_FILE=memory keeps none from one start to the next: set DATA_FILE to a file/)
  })

  it('PASSWORD_SIGN_IN=off on an IP address, where passkeys cannot work', async () => {
    const result = await runLatch([], { PASSWORD_SIGN_IN: 'off', PASSWORD_HASH, DATA_FILE: 'memory', PORT: '0' })
    assertOneLineFailure(result, /PASSWORD_SIGN_IN=off leaves only passkeys, which cannot work on ISSUER http:\/\/127/)
  })
})

describe('Run, or imported', () => {
  const run = (file: string, args: string[]) =>
    spawnSync(process.execPath, ['--import', 'tsx', file, ...args], {
      cwd: ROOT,
      env: childEnv({ PORT: '0', DATA_FILE: 'memory' }),
      encoding: 'utf8',
      timeout: CHILD_TIMEOUT_MS,
    })

  it('starts no Latch of its own when a bundler has inlined server.ts into an app', async () => {
    // what esbuild makes of an app that imports server.ts: imports first, Latch, then the app, one
    // file; Latch's licence comment, if kept, at its end
    const source = readFileSync(join(ROOT, 'server.ts'), 'utf8')
    const comment = source.slice(0, source.indexOf('*/') + 2)
    for (const app of [
      `console.log('the app ran')`,
      `await new Promise((resolve) => setTimeout(resolve, 10))\nconsole.log('the app ran')`,
    ]) {
      const bundle = join(directory, 'bundle.mts') // an ES module, as an app's top-level await needs
      await writeFile(bundle, `// server.ts\nimport 'node:http'\n${source.slice(comment.length)}\n${app}\n${comment}\n`)
      const result = run(bundle, ['--verbose']) // a flag of the app's own
      assert.equal(result.status, 0, result.stderr)
      assert.equal(result.stdout, 'the app ran\n')
      assert.equal(result.stderr, '')
    }
  })

  for (const [what, top, crlf] of [
    ['under another name', ''],
    ['with a byte-order mark', '\ufeff'],
    ['with a licence line on top', '// SPDX-License-Identifier: MIT\n\n'],
    ['with a licence comment on top', '/*! (c) someone, MIT */\n'],
    ['with Windows line ends and a #! line', '#!/usr/bin/env -S npx tsx\r\n', true],
    ['as a compiler may begin it', '"use strict";\n'],
  ] as const) {
    it(`runs as the command ${what}`, async () => {
      const copy = join(directory, `latch-${what.replace(/\W+/g, '-')}.ts`)
      const source = readFileSync(join(ROOT, 'server.ts'), 'utf8')
      await writeFile(copy, top + (crlf === true ? source.replaceAll('\n', '\r\n') : source))
      const result = run(copy, ['--help'])
      assert.equal(result.status, 0, result.stderr)
      assert.match(result.stdout, /^Latch: an IndieAuth authorization server/)
    })
  }
})

// --- --help and hash-password --------------------------------------------------------------

describe('--help', () => {
  it('prints lines of at most 80 characters, naming every setting', async () => {
    const result = await runLatch(['--help'], {})
    assert.equal(result.code, 0, result.stderr)
    for (const line of result.stdout.split('\n')) assert.ok(line.length <= 80, `${line.length}: ${line}`)
    for (const setting of SETTINGS) assert.match(result.stdout, new RegExp(`^  ${setting.name}\\b`, 'm'))
  })
})

describe('hash-password', () => {
  /**
   * Types into hash-password on a terminal of its own: `keys` at once, or each of `atPrompts` once
   * its prompt is shown. What it printed, and how it ended.
   */
  async function typeIntoHashPassword(
    keys: string,
    atPrompts: string[] = [],
  ): Promise<{ code: unknown; output: string }> {
    // `script` runs the command on a terminal of its own, and types what it reads from its input
    const command = `${process.execPath} --import tsx server.ts hash-password`
    const child = spawn('script', ['-qec', command, '/dev/null'], { cwd: ROOT, env: childEnv({}) })
    let output = ''
    let prompted = 0
    child.stdout.setEncoding('utf8').on('data', (chunk: string) => {
      output += chunk
      const prompts = output.match(/(Password[^:\n]*|Again): $/gm)?.length ?? 0
      for (; prompted < prompts && prompted < atPrompts.length; prompted++) child.stdin.write(atPrompts[prompted])
      if (atPrompts.length > 0 && prompted === atPrompts.length) child.stdin.end()
    })
    const timer = setTimeout(() => child.kill('SIGKILL'), CHILD_TIMEOUT_MS)
    if (atPrompts.length === 0) child.stdin.end(keys)
    const code = await new Promise((resolve) => child.on('close', resolve))
    clearTimeout(timer)
    return { code, output }
  }

  const noTerminal = spawnSync('script', ['--version']).status !== 0

  it(
    'reads both entries on a terminal when they come at once, as a pasted password does',
    { timeout: 30_000 },
    async (t) => {
      if (noTerminal) return t.skip('no `script` (util-linux) to give it a terminal')
      const { code, output } = await typeIntoHashPassword('correct horse battery\rcorrect horse battery\r')
      assert.equal(code, 0, output)
      const hash = /^scrypt:\S+/m.exec(output)?.[0] ?? ''
      assert.equal(await verifyPassword('correct horse battery', hash), true, output)
    },
  )

  it('erases a whole code point at Backspace: 🔑, not half of its surrogate pair', { timeout: 30_000 }, async (t) => {
    if (noTerminal) return t.skip('no `script` (util-linux) to give it a terminal')
    // each once it asks, as a person types: the terminal is raw by then, and Latch reads every key
    const { code, output } = await typeIntoHashPassword('', [
      'correct horse battery\u{1F511}\x7f\r',
      'correct horse battery\r',
    ])
    assert.equal(code, 0, output)
    const hash = /^scrypt:\S+/m.exec(output)?.[0] ?? ''
    assert.equal(await verifyPassword('correct horse battery', hash), true, output)
  })

  it(
    'says how long a password must be, and reads both entries, hidden, before it refuses a short one',
    { timeout: 30_000 },
    async (t) => {
      if (noTerminal) return t.skip('no `script` (util-linux) to give it a terminal')
      const { code, output } = await typeIntoHashPassword('', ['too short\r', 'too short\r'])
      assert.notEqual(code, 0, output)
      // the second entry is read at its prompt, not left to the shell to show and keep
      assert.match(output, /Password \(15 characters or more\): \r?\nAgain: /)
      assert.match(output, /shorter than 15 characters/)
      assert.doesNotMatch(output, /too short|scrypt:/)
    },
  )

  it('erases the line typed so far at Ctrl-U, as passwd and sudo do', { timeout: 30_000 }, async (t) => {
    if (noTerminal) return t.skip('no `script` (util-linux) to give it a terminal')
    const { code, output } = await typeIntoHashPassword('', [
      'a wrong start\u0015correct horse battery\r',
      'correct horse battery\r',
    ])
    assert.equal(code, 0, output)
    const hash = /^scrypt:\S+/m.exec(output)?.[0] ?? ''
    assert.equal(await verifyPassword('correct horse battery', hash), true, output)
  })

  it(
    'names a control key typed at the first prompt, not a difference from the second',
    { timeout: 30_000 },
    async (t) => {
      if (noTerminal) return t.skip('no `script` (util-linux) to give it a terminal')
      const { code, output } = await typeIntoHashPassword('', [
        'correct horse battery\x1b[D\r',
        'correct horse battery\r',
      ])
      assert.notEqual(code, 0, output)
      assert.match(output, /control key/)
      assert.doesNotMatch(output, /differ|scrypt:/)
    },
  )

  it('prints its usage for --help, without asking for a password, and refuses another argument', async () => {
    const help = await runLatch(['hash-password', '--help'], {}, { input: 'a password of some length\n' })
    assert.equal(help.code, 0, help.stderr)
    assert.match(help.stdout, /^Usage: npx tsx server\.ts hash-password\n/)
    assert.doesNotMatch(help.stdout, /scrypt:/)
    assertOneLineFailure(await runLatch(['hash-password', '--cost=20'], {}), /hash-password takes no arguments/)
    const given = await runLatch(['hash-password', 'my very secret passphrase'], {})
    assertOneLineFailure(given, /hash-password takes no arguments/)
    assert.doesNotMatch(given.stderr, /secret/) // not said back: it may be the password
  })

  it('refuses 14 characters, citing NIST SP 800-63B-4, and hashes 15', async () => {
    const short = await runLatch(['hash-password'], {}, { input: '12345678901234\n' })
    assertOneLineFailure(short, /\b15 characters\b.*NIST SP 800-63B-4/)
    assert.equal(short.stdout, '')
    const long = await runLatch(['hash-password'], {}, { input: '123456789012345\n' })
    assert.equal(long.code, 0, long.stderr)
    assert.match(long.stdout, /^scrypt:\S+\n$/)
  })

  it('refuses more than 1,024 characters, more than a form is sure to send whole, and hashes 1,024', async () => {
    const tooLong = await runLatch(['hash-password'], {}, { input: `${'é'.repeat(1025)}\n` })
    assertOneLineFailure(tooLong, /longer than 1024 characters/)
    assert.equal(tooLong.stdout, '')
    const longest = await runLatch(['hash-password'], {}, { input: `${'é'.repeat(1024)}\n` })
    assert.equal(longest.code, 0, longest.stderr)
    assert.match(longest.stdout, /^scrypt:\S+\n$/)
  })

  it('refuses a password piped in as Latin-1 or UTF-16, which no browser would send as it was hashed', async () => {
    for (const encoding of ['latin1', 'utf16le'] as const) {
      const refused = await runLatch(['hash-password'], {}, { input: Buffer.from('pässwörd über alles\n', encoding) })
      assertOneLineFailure(refused, /not UTF-8.*set the terminal, or the file piped in, to UTF-8/)
      assert.equal(refused.stdout, '')
    }
  })

  it('hashes the password of a file that begins with a byte order mark without it, as a browser sends it', async () => {
    const hashed = await runLatch(['hash-password'], {}, { input: '\ufeffcorrect horse battery staple\n' })
    assert.equal(hashed.code, 0, hashed.stderr)
    assert.equal(await verifyPassword('correct horse battery staple', hashed.stdout.trim()), true)
  })

  it('refuses a password with a control key in it, an arrow typed at the prompt, say', async () => {
    for (const input of [
      'correct horse battery\x1b[D\n',
      'correct horse\tbattery staple\n',
      'correct horse battery\x7f\n',
    ]) {
      const refused = await runLatch(['hash-password'], {}, { input })
      assertOneLineFailure(refused, /control key .* run the command again/)
      assert.equal(refused.stdout, '')
    }
  })

  it('gives up at Ctrl-D on a terminal, printing no hash', { timeout: 30_000 }, async (t) => {
    if (noTerminal) return t.skip('no `script` (util-linux) to give it a terminal')
    const { code, output } = await typeIntoHashPassword('', [
      '\u0004correct horse battery\r',
      'correct horse battery\r',
    ])
    assert.notEqual(code, 0, output)
    assert.doesNotMatch(output, /scrypt:|Again: /)
  })

  it('says no password was given when its input is empty, not that the password is short', async () => {
    for (const input of ['', '\n']) {
      const empty = await runLatch(['hash-password'], {}, { input })
      assertOneLineFailure(empty, /^latch: No password was given \(its input was empty\)/)
      assert.equal(empty.stdout, '')
    }
  })
})

// --- The start-up block --------------------------------------------------------------------

/** The last line of the text start-up block. */
const isMetadataLine = (line: string) => /^ {2}metadata /.test(line)

describe('The start-up block', () => {
  it('starts with PASSWORD_SIGN_IN=off once the data file holds a passkey, and says so', async () => {
    const file = join(directory, 'passkey.jsonl')
    await writeFile(file, `${JSON.stringify({ set: 'passkey', key: 'credential-1', value: PASSKEY })}\n`)
    const settings = { PASSWORD_SIGN_IN: 'off', PASSWORD_HASH, ISSUER: 'http://localhost:3000', PORT: '0' }
    const latch = serve({ ...settings, DATA_FILE: file })
    try {
      await latch.waitForLine(isMetadataLine, 'start-up block')
      assert.match(latch.lines.join('\n'), /^ {2}password +off: 1 passkey$/m)
    } finally {
      await latch.stop()
    }
  })

  it('says how many passkeys are for this host when some were made for another', async () => {
    const file = join(directory, 'passkeys-two-hosts.jsonl')
    const lines = [
      { set: 'passkey', key: 'credential-1', value: { ...PASSKEY, rpId: 'old.example' } },
      { set: 'passkey', key: 'credential-2', value: { ...PASSKEY, rpId: 'localhost' } },
    ]
    await writeFile(file, lines.map((line) => `${JSON.stringify(line)}\n`).join(''))
    const settings = { PASSWORD_SIGN_IN: 'off', PASSWORD_HASH, ISSUER: 'http://localhost:3000', PORT: '0' }
    const latch = serve({ ...settings, DATA_FILE: file })
    try {
      await latch.waitForLine(isMetadataLine, 'start-up block')
      assert.match(latch.lines.join('\n'), /^ {2}password +off: 2 passkeys, 1 for this host$/m)
    } finally {
      await latch.stop()
    }
  })

  it('says where OAuth clients look for the metadata of an ISSUER with a path, outside Latch', async () => {
    const latch = serve({ DATA_FILE: 'memory', PORT: '0', ISSUER: 'http://127.0.0.1:3000/latch' })
    try {
      await latch.waitForLine(isMetadataLine, 'start-up block')
      const block = latch.lines.join('\n')
      assert.match(
        block,
        /^ {2}oauth {5}http:\/\/127\.0\.0\.1:3000\/\.well-known\/oauth-authorization-server\/latch: OAuth and MCP clients look/m,
      )
      assert.match(
        block,
        /^ {2}metadata {2}http:\/\/127\.0\.0\.1:3000\/latch\/\.well-known\/oauth-authorization-server$/m,
      )
    } finally {
      await latch.stop()
    }
  })

  it('warns of nothing with no settings, and says that ME is the default', async () => {
    const latch = serve({ DATA_FILE: 'memory', PORT: '0' })
    try {
      await latch.waitForLine(isMetadataLine, 'start-up block')
      const block = latch.lines.join('\n')
      assert.doesNotMatch(block, /^warning:/m)
      assert.match(block, /^ {2}me +http:\/\/127\.0\.0\.1:\d+\/ \(the default/m)
    } finally {
      await latch.stop()
    }
  })

  it('counts the codes not redeemed yet and the tokens not rotated away, not the used ones', async () => {
    const file = join(directory, 'codes.jsonl')
    const now = Date.now()
    const code = (usedAt?: number) => ({
      client_id: CLIENT_ID,
      client_name: 'An app',
      redirect_uri: REDIRECT_URI,
      code_challenge: CHALLENGE,
      scope: ['create'],
      me: 'https://example.com/',
      accessTokenTtlSeconds: 3600,
      issuedAt: now,
      expiresAt: now + 600_000,
      ...(usedAt === undefined ? {} : { usedAt }),
    })
    const grant = {
      client_id: CLIENT_ID,
      me: 'https://example.com/',
      scope: ['create'],
      accessTokenTtlSeconds: 3600,
      approvedAt: now,
      lastUsedAt: now,
      expiresAt: now + 86_400_000,
    }
    const token = (kind: string, usedAt?: number) => ({
      kind,
      grantId: 'g',
      scope: ['create'],
      issuedAt: now,
      expiresAt: now + 86_400_000,
      ...(usedAt === undefined ? {} : { usedAt }),
    })
    const records = [
      { set: 'code', key: hashSecret('a redeemed code'), value: code(now) },
      { set: 'code', key: hashSecret('an unredeemed code'), value: code() },
      { set: 'grant', key: 'g', value: grant },
      { set: 'token', key: hashSecret('a rotated refresh token'), value: token('refresh', now) },
      { set: 'token', key: hashSecret('the refresh token'), value: token('refresh') },
      { set: 'token', key: hashSecret('an access token'), value: token('access') },
    ]
    await writeFile(file, records.map((record) => `${JSON.stringify(record)}\n`).join(''))
    const latch = serve({ DATA_FILE: file, PORT: '0' })
    try {
      await latch.waitForLine(isMetadataLine, 'start-up block')
      assert.match(latch.lines.join('\n'), /^ {2}data +.*codes\.jsonl: 1 live code, 2 live tokens and 1 grant loaded$/m)
    } finally {
      await latch.stop()
    }
  })
})

// --- LOG_FORMAT=json -------------------------------------------------------------------------

describe('LOG_FORMAT=json', () => {
  it('writes the start-up block and each request as one JSON object per line', async () => {
    const latch = serve({ LOG_FORMAT: 'json', DATA_FILE: 'memory', PORT: '0' })
    try {
      const isStart = (line: string) => line.includes('"event":"start"')
      const startLine = await latch.waitForLine(
        (line) => isStart(line) || line.startsWith('Latch is listening'),
        'start-up line',
      )
      for (const line of latch.lines) assert.doesNotThrow(() => JSON.parse(line), `not JSON: ${line}`)
      const start = JSON.parse(startLine) as Record<string, unknown>
      assert.equal(start.event, 'start')
      assert.match(String(start.listening), /^http:\/\/127\.0\.0\.1:\d+$/)
      assert.ok(!Number.isNaN(Date.parse(String(start.time))), String(start.time))
      const base = String(start.listening)

      assert.equal((await fetch(`${base}/.well-known/oauth-authorization-server`)).status, 200)
      assert.equal((await fetch(`${base}/nope`)).status, 404)
      const metadataLine = await latch.waitForLine(
        (line) => line.includes('/.well-known/oauth-authorization-server') && !isStart(line),
        'log line of the metadata request',
      )
      const unknownLine = await latch.waitForLine((line) => line.includes('"status":404'), 'log line of GET /nope')
      for (const line of latch.lines) assert.doesNotThrow(() => JSON.parse(line), `not JSON: ${line}`)

      const metadata = JSON.parse(metadataLine) as Record<string, unknown>
      assert.deepEqual(Object.keys(metadata), ['time', 'address', 'method', 'path', 'status', 'ms'])
      assert.ok(!Number.isNaN(Date.parse(String(metadata.time))), String(metadata.time))
      assert.equal(metadata.address, '127.0.0.1')
      assert.equal(metadata.method, 'GET')
      assert.equal(metadata.path, '/.well-known/oauth-authorization-server')
      assert.equal(metadata.status, 200)
      assert.equal(typeof metadata.ms, 'number')

      const unknown = JSON.parse(unknownLine) as Record<string, unknown>
      assert.deepEqual(Object.keys(unknown), ['time', 'address', 'method', 'path', 'status', 'ms', 'error'])
      assert.equal(unknown.method, 'GET')
      assert.doesNotMatch(String(unknown.path), /nope/) // a path no endpoint has is not logged as sent
      assert.equal(unknown.error, 'not_found')
    } finally {
      await latch.stop()
    }
  })
})

describe('Stopping', () => {
  it('stops at SIGHUP, even two and a SIGTERM, as at SIGTERM, its log written first: a terminal closed, or a rotation script', async () => {
    const latch = serve({ LOG_FORMAT: 'json', DATA_FILE: 'memory', PORT: '0' })
    try {
      const startLine = await latch.waitForLine((line) => line.includes('"event":"start"'), 'start-up line')
      const base = String((JSON.parse(startLine) as Record<string, unknown>).listening)
      assert.equal((await fetch(`${base}/.well-known/oauth-authorization-server`)).status, 200)
      // a request in flight, its body held back, so that the stop takes until it is answered
      const { port } = new URL(base)
      const inFlight = connect(Number(port), '127.0.0.1')
      let answer = ''
      inFlight.setEncoding('latin1').on('data', (chunk: string) => (answer += chunk))
      const body = 'token=x'
      inFlight.write('POST /revoke HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n')
      inFlight.write(`Content-Length: ${body.length}\r\n\r\ntok`)
      await fetch(`${base}/`) // a round trip: the server has read the request in flight meanwhile
      const closed = new Promise((resolve) => latch.child.on('close', (code, signal) => resolve(signal ?? code)))
      latch.child.kill('SIGHUP') // at once: the request's line still waits in the log's batch
      await latch.waitForLine((line) => line.includes('"event":"SIGHUP"'), 'the SIGHUP line')
      latch.child.kill('SIGHUP') // a terminal closing sends two
      latch.child.kill('SIGTERM') // and a session manager then a SIGTERM: the stop goes on
      inFlight.end(body.slice(3))
      assert.equal(await closed, 'SIGHUP') // it ends as a hang-up does, once stopped
      assert.match(answer, /^HTTP\/1\.1 200 /) // the request in flight was answered
      assert.ok(
        latch.lines.some(
          (line) => line.includes('/.well-known/oauth-authorization-server') && line.includes('"status"'),
        ),
        latch.lines.join('\n'),
      )
      assert.ok(
        latch.lines.some((line) => /"event":"SIGHUP","message":"finishing requests in flight/.test(line)),
        latch.lines.join('\n'),
      )
    } finally {
      await latch.stop()
    }
  })
})

/** Starts the command line with flags of Node's own and settings, its output kept as it comes. */
function startWithFlags(flags: string[], settings: Record<string, string> = {}) {
  const child = spawn(process.execPath, [...flags, '--import', 'tsx', 'server.ts'], {
    cwd: ROOT,
    env: childEnv({ DATA_FILE: 'memory', PORT: '0', ...settings }),
  })
  const output = { stdout: '', stderr: '' }
  child.stdout.on('data', (chunk) => (output.stdout += chunk))
  child.stderr.on('data', (chunk) => (output.stderr += chunk))
  const closed = new Promise((resolve) => child.on('close', resolve))
  return {
    output,
    started: () => until(() => output.stdout.includes('metadata'), CHILD_TIMEOUT_MS),
    debuggerPort: () => Number(/Debugger listening on ws:\/\/127\.0\.0\.1:(\d+)\//.exec(output.stderr)?.[1]),
    stop: async () => {
      child.kill('SIGTERM')
      await closed
    },
  }
}

/** Whether anything takes connections on a port of 127.0.0.1. */
function listensOn(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect(port, '127.0.0.1')
    socket.on('connect', () => resolve(Boolean(socket.destroy()))).on('error', () => resolve(false))
  })
}

describe('Signals', () => {
  // a preload opens one, as a SIGUSR1 in Node's first moments does; --inspect-port only says where
  for (const flags of [[], ['--inspect-port=127.0.0.1:0']])
    it(`closes a debugger that a SIGUSR1 opened while Latch was still loading ${flags.join(' ')}`, async () => {
      const opening = `data:text/javascript,${encodeURIComponent("import i from 'node:inspector'; i.open(0, '127.0.0.1')")}`
      const latch = startWithFlags([...flags, '--import', opening])
      try {
        assert.ok(await latch.started(), `${latch.output.stdout}\n${latch.output.stderr}`)
        const said = () => /SIGUSR1: a debugger open at start without --inspect was closed/.test(latch.output.stdout)
        assert.ok(await until(said, CHILD_TIMEOUT_MS), latch.output.stdout) // the log's lines go out every 100 ms
        assert.ok(latch.debuggerPort() > 0, latch.output.stderr)
        assert.equal(await listensOn(latch.debuggerPort()), false, 'the debugger still listens')
      } finally {
        await latch.stop()
      }
    })

  it('leaves open a debugger asked for with --inspect, quoted in NODE_OPTIONS as Node reads it', async () => {
    const latch = startWithFlags([], { NODE_OPTIONS: '"--inspect=127.0.0.1:0"' })
    try {
      assert.ok(await latch.started(), `${latch.output.stdout}\n${latch.output.stderr}`)
      assert.equal(await listensOn(latch.debuggerPort()), true, latch.output.stderr)
    } finally {
      await latch.stop()
    }
  })

  it('ignores SIGUSR1, which would open a debugger that any user of the machine could reach', async () => {
    const latch = serve({ LOG_FORMAT: 'json', DATA_FILE: 'memory', PORT: '0' })
    let stderr = ''
    latch.child.stderr.on('data', (chunk: string) => (stderr += chunk))
    try {
      const startLine = await latch.waitForLine((line) => line.includes('"event":"start"'), 'start-up line')
      const base = String((JSON.parse(startLine) as Record<string, unknown>).listening)
      latch.child.kill('SIGUSR1') // nginx's signal to reopen logs, which a rotation script may send
      await latch.waitForLine((line) => line.includes('"event":"SIGUSR1"'), 'the SIGUSR1 line')
      assert.equal((await fetch(`${base}/.well-known/oauth-authorization-server`)).status, 200)
      assert.doesNotMatch(stderr, /Debugger/)
    } finally {
      await latch.stop()
    }
  })
})

// --- The log of requests and security events, in process -----------------------------------

const ISO_TIME = String.raw`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z`
/** `<ISO time> <address> <METHOD> <path> <status> <n>ms[ error=<code>][ client_id=<id>]` */
const REQUEST_LINE = new RegExp(
  `^${ISO_TIME} (\\S+) (GET|HEAD|POST|OPTIONS) (\\S+) (\\d{3}) \\d+ms(?: error=([a-z_]+))?(?: client_id=(\\S+))?$`,
)
/** `<ISO time> [<address>] <event>: <message>` */
const EVENT_LINE = new RegExp(`^${ISO_TIME} (?:\\S+ )?(security|discovery|error): `)

function authorizationUrl(latch: TestServer): string {
  const query = new URLSearchParams({
    response_type: 'code',
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    state: 'state-1234',
    code_challenge: CHALLENGE,
    code_challenge_method: 'S256',
    scope: 'profile create',
    me: 'https://example.com/',
  })
  return `${latch.base}/auth?${query}`
}

function post(url: string, fields: Record<string, string>, headers: Record<string, string> = {}): Promise<Response> {
  return fetch(url, {
    method: 'POST',
    redirect: 'manual',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', ...headers },
    body: new URLSearchParams(fields).toString(),
  })
}

type Consent = { request: string; csrf: string; cookie: string }

/** Opens the consent page and reads its form's hidden fields and the CSRF cookie. */
async function openConsent(latch: TestServer): Promise<Consent> {
  const response = await fetch(authorizationUrl(latch), { redirect: 'manual' })
  const html = await response.text()
  assert.equal(response.status, 200, html)
  return {
    request: /name="request" value="([^"]+)"/.exec(html)?.[1] ?? '',
    csrf: /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? '',
    cookie: (response.headers.get('set-cookie') ?? '').split(';')[0],
  }
}

function submitConsent(latch: TestServer, consent: Consent, fields: Record<string, string> = {}): Promise<Response> {
  const body = { request: consent.request, csrf: consent.csrf, scope: 'create', decision: 'approve', ...fields }
  return post(`${latch.base}/auth/consent`, body, { Cookie: consent.cookie })
}

async function obtainCode(latch: TestServer, fields: Record<string, string> = {}): Promise<string> {
  const response = await submitConsent(latch, await openConsent(latch), fields)
  assert.equal(response.status, 303)
  const code = new URL(response.headers.get('location') ?? '').searchParams.get('code')
  assert.ok(code)
  return code
}

function exchange(latch: TestServer, code: string): Promise<Response> {
  return post(`${latch.base}/token`, {
    grant_type: 'authorization_code',
    code,
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    code_verifier: VERIFIER,
  })
}

function refresh(latch: TestServer, refreshToken: string): Promise<Response> {
  return post(`${latch.base}/token`, { grant_type: 'refresh_token', refresh_token: refreshToken, client_id: CLIENT_ID })
}

/** Lets the server log the requests just answered: it does so when their response closes. */
async function settle(...responses: Response[]): Promise<void> {
  for (const response of responses) await response.arrayBuffer()
  await new Promise((resolve) => setImmediate(resolve))
}

/** Every line is a request line or an event line, and none holds a secret or the hash of one. */
function assertCleanLog(logs: string[], secrets: string[], hashed: string[]): void {
  assert.ok(logs.length > 0)
  for (const line of logs) {
    assert.ok(REQUEST_LINE.test(line) || EVENT_LINE.test(line), `a line of neither form: ${line}`)
    for (const secret of secrets) assert.ok(!line.includes(secret), `${line} holds a secret (${secret})`)
    for (const secret of hashed) assert.ok(!line.includes(hashSecret(secret)), `${line} holds the hash of ${secret}`)
  }
}

/** The log lines of requests to a method and path, parsed. */
function requestLines(logs: string[], method: string, path: string) {
  return logs.flatMap((line) => {
    const match = REQUEST_LINE.exec(line)
    if (match === null || match[2] !== method || match[3] !== path) return []
    const [, address, , , status, error, clientId] = match
    return [{ line, address, status: Number(status), error, clientId }]
  })
}

describe('The log: one line per request, and security events', () => {
  it('logs a replayed code, with client_id on every /token line and no secret', async () => {
    const latch = await startLatch()
    try {
      const consent = await openConsent(latch)
      const approved = await submitConsent(latch, consent)
      const code = new URL(approved.headers.get('location') ?? '').searchParams.get('code') ?? ''
      const first = await exchange(latch, code)
      assert.equal(first.status, 200)
      const tokens = (await first.json()) as { access_token: string; refresh_token: string }
      const replayed = await exchange(latch, code)
      assert.equal(replayed.status, 400)
      await settle(replayed)
      assert.ok(
        latch.logs.some((line) =>
          new RegExp(`^${ISO_TIME} 127\\.0\\.0\\.1 security: a code issued to ${CLIENT_ID} was redeemed again`).test(
            line,
          ),
        ),
        latch.logs.join('\n'),
      )
      const tokenLines = requestLines(latch.logs, 'POST', '/token')
      assert.equal(tokenLines.length, 2, latch.logs.join('\n'))
      for (const { clientId } of tokenLines) assert.equal(clientId, CLIENT_ID)
      assert.deepEqual(
        tokenLines.map(({ status, error }) => [status, error]),
        [
          [200, undefined],
          [400, 'invalid_grant'],
        ],
      )
      for (const { address } of tokenLines) assert.equal(address, '127.0.0.1')
      const secrets = [code, tokens.access_token, tokens.refresh_token, VERIFIER, consent.csrf, consent.request]
      assertCleanLog(latch.logs, secrets, [code, tokens.access_token, tokens.refresh_token])
    } finally {
      await latch.close()
    }
  })

  it('logs a refresh token used again after the grace period', async () => {
    const latch = await startLatch({ REFRESH_TOKEN_GRACE: '0' })
    try {
      const code = await obtainCode(latch)
      const issued = (await (await exchange(latch, code)).json()) as { access_token: string; refresh_token: string }
      const rotated = await refresh(latch, issued.refresh_token)
      assert.equal(rotated.status, 200)
      const second = (await rotated.json()) as { access_token: string; refresh_token: string }
      latch.advance(5)
      const reused = await refresh(latch, issued.refresh_token)
      assert.equal(reused.status, 400)
      await settle(reused)
      assert.ok(
        latch.logs.some((line) =>
          new RegExp(`^${ISO_TIME} 127\\.0\\.0\\.1 security: a refresh token of ${CLIENT_ID} was used again`).test(
            line,
          ),
        ),
        latch.logs.join('\n'),
      )
      const refused = requestLines(latch.logs, 'POST', '/token').at(-1)
      assert.equal(refused?.error, 'invalid_grant')
      assert.equal(refused?.clientId, CLIENT_ID)
      const tokens = [issued.access_token, issued.refresh_token, second.access_token, second.refresh_token]
      assertCleanLog(latch.logs, [code, VERIFIER, ...tokens], [code, ...tokens])
    } finally {
      await latch.close()
    }
  })

  it('logs a consent form sent without the right csrf', async () => {
    const latch = await startLatch()
    try {
      const consent = await openConsent(latch)
      const refused = await submitConsent(latch, consent, { csrf: 'not-the-token-of-this-page' })
      assert.equal(refused.status, 403)
      await settle(refused)
      assert.ok(
        latch.logs.some((line) =>
          new RegExp(`^${ISO_TIME} 127\\.0\\.0\\.1 security: a form sent to /auth/consent was refused`).test(line),
        ),
        latch.logs.join('\n'),
      )
      const [line] = requestLines(latch.logs, 'POST', '/auth/consent')
      assert.equal(line?.status, 403)
      assert.equal(line?.error, 'access_denied')
      assertCleanLog(latch.logs, [consent.csrf, consent.request], [])
    } finally {
      await latch.close()
    }
  })

  it('logs too many wrong passwords from one address, and never a password or its hash', async () => {
    const latch = await startLatch({ PASSWORD_HASH })
    try {
      const consent = await openConsent(latch)
      const guesses = Array.from({ length: 6 }, (_, i) => `wrong guess ${i}`)
      for (const password of guesses) {
        const wrong = await submitConsent(latch, consent, { password })
        assert.equal(wrong.status, 401)
        await settle(wrong)
      }
      const lockouts = latch.logs.filter((line) =>
        new RegExp(`^${ISO_TIME} 127\\.0\\.0\\.1 security: too many wrong passwords from 127\\.0\\.0\\.1`).test(line),
      )
      assert.equal(lockouts.length, 1, latch.logs.join('\n'))
      const hashParts = PASSWORD_HASH.split(':')
      assertCleanLog(latch.logs, [...guesses, PASSWORD, PASSWORD_HASH, ...hashParts.slice(2), consent.csrf], [])
    } finally {
      await latch.close()
    }
  })

  it('logs the X-Forwarded-For address only from a proxy of TRUST_PROXY, and warns once of a proxy it does not name', async () => {
    const headers = { 'X-Forwarded-For': '203.0.113.7' }
    const path = '/.well-known/oauth-authorization-server'
    // with a password: without one, a request through a proxy is refused (and TRUST_PROXY too)
    const behind = await startLatch({ TRUST_PROXY: '127.0.0.1', PASSWORD_HASH })
    const direct = await startLatch({ PASSWORD_HASH })
    const elsewhere = await startLatch({ TRUST_PROXY: '10.0.0.5', PASSWORD_HASH }) // names another proxy, not the one on loopback
    try {
      const viaProxy = await fetch(`${behind.base}${path}`, { headers })
      const notViaProxy = await fetch(`${direct.base}${path}`, { headers })
      assert.equal(viaProxy.status, 200)
      assert.equal(notViaProxy.status, 200)
      await settle(viaProxy, notViaProxy)
      assert.deepEqual(
        requestLines(behind.logs, 'GET', path).map(({ address }) => address),
        ['203.0.113.7'],
        behind.logs.join('\n'),
      )
      assert.deepEqual(
        requestLines(direct.logs, 'GET', path).map(({ address }) => address),
        ['127.0.0.1'],
        direct.logs.join('\n'),
      )
      // a proxy on this machine that TRUST_PROXY does not name: said once, with the fix
      await settle(await fetch(`${direct.base}${path}`, { headers }))
      const warnings = direct.logs.filter((line) => / warning: .*X-Forwarded-For/.test(line))
      assert.equal(warnings.length, 1, direct.logs.join('\n'))
      assert.match(warnings[0], /add 127\.0\.0\.1,::1 to TRUST_PROXY$/)
      assert.ok(!behind.logs.some((line) => / warning: /.test(line)), behind.logs.join('\n')) // its proxy is named
      // TRUST_PROXY set, but not to this proxy: said too
      await settle(await fetch(`${elsewhere.base}${path}`, { headers }))
      const missed = elsewhere.logs.filter((line) => / warning: .*X-Forwarded-For/.test(line))
      assert.equal(missed.length, 1, elsewhere.logs.join('\n'))
      // a named proxy first does not silence it for another on this machine
      const status = await new Promise<number | undefined>((resolve, reject) =>
        httpRequest(`${behind.base}${path}`, { headers, localAddress: '127.0.0.2' }, (response) => {
          response.resume().on('end', () => resolve(response.statusCode))
        })
          .on('error', reject)
          .end(),
      )
      assert.equal(status, 200)
      await new Promise((resolve) => setImmediate(resolve))
      const unnamed = behind.logs.filter((line) => / warning: .*X-Forwarded-For/.test(line))
      assert.equal(unnamed.length, 1, behind.logs.join('\n'))
    } finally {
      await behind.close()
      await direct.close()
      await elsewhere.close()
    }
  })
})
