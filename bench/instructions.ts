// (j) Instructions per request: what a server executes for one request, counted by valgrind's callgrind
// rather than timed. CPU time on two shared cores moves by a tenth from one run to the next, more than
// most changes to the code save; the count of instructions hardly moves with whatever else the machine
// does: Latch's moved by 1 to 2% from one run to the next (the bare server's and the peer's by up to 7
// and 9%, how many requests one turn of the event loop takes varying more there), so that a change of a
// few percent to Latch shows.
//
// bench/run.ts starts each server under callgrind with its instrumentation off: at native code, only a
// few times slower. The bench warms the server up, then turns the instrumentation on
// (`callgrind_control -i on`), sends the requests it counts, and has the counts written
// (`callgrind_control -d`, to `<file>.1`, `.2`, …) and zeroed, and the instrumentation turned off again.
//
// What counts is what runs inside libuv's poll for I/O (`uv__io_poll`), on the main thread: reading a
// request, parsing it, the handler and the promises it awaits, the answer and its writes. Not what timers
// run: under valgrind a request takes tens of times longer, while a timer fires as often per second as
// ever, so Latch's sweep of expired entries every 100 ms, and its log written in batches, would count
// tens of times over. Nor the collector's helper threads. Instructions are not time either: a cache miss
// costs more than a hundred of them, valgrind offers no SHA instructions (so SHA-256 counts the longer
// way), and the kernel's work (the socket writes) is not counted. Read the counts beside CPU time.
//
// valgrind is a Debian package (`apt-get install valgrind`); without it the figure is left out, and says so.

import { execFile, execFileSync } from 'node:child_process'
import { readFile } from 'node:fs/promises'
import { promisify } from 'node:util'

const run = promisify(execFile)

/** The command line that starts a node process under callgrind, its counts written to `file` and `file.N`. */
export function underCallgrind(file: string): string[] {
  return [
    'valgrind',
    '--tool=callgrind',
    '--instr-atstart=no',
    '--collect-atstart=no',
    '--toggle-collect=uv__io_poll',
    `--callgrind-out-file=${file}`,
  ]
}

/** Whether callgrind is on this machine, or why not. */
export function callgrindMissing(): string | undefined {
  try {
    execFileSync('valgrind', ['--version'], { stdio: 'ignore' }) // callgrind_annotate comes with it
    return undefined
  } catch {
    return 'valgrind is not installed (apt-get install valgrind)'
  }
}

/** A server under callgrind: counts what runs while `requests` are answered, and returns the instructions. */
export class Counter {
  readonly pid: number
  readonly file: string
  #dumps = 0

  constructor(pid: number, file: string) {
    this.pid = pid
    this.file = file
  }

  async count(requests: () => Promise<void>): Promise<number> {
    await this.#control('-i', 'on')
    await requests()
    await this.#control('-d')
    await this.#control('-i', 'off')
    return instructionsIn(`${this.file}.${++this.#dumps}`)
  }

  async #control(...args: string[]): Promise<void> {
    await run('callgrind_control', [...args, String(this.pid)])
  }
}

/** The instructions a dump counted. */
async function instructionsIn(dump: string): Promise<number> {
  // the file's `totals:` line: its `summary:` line is wrong once the instrumentation was turned off and on again
  const total = /^totals: (\d+)$/m.exec(await readFile(dump, 'utf8'))
  if (total === null) throw new Error(`no totals in ${dump}`)
  return Number(total[1])
}
