// The limit: a bare node:http server answering the same request shapes as Latch, with nothing
// else. A POST reads its whole form body; every answer carries the headers Latch sent for that
// path and a body of the same length, so that both servers put the same bytes on the wire.
// bench/run.ts takes those from Latch and passes them in BARE_ANSWERS, a JSON object of
// `{ [path]: { headers, bytes } }`. Prints `listening <port>` once it listens.

import { createServer } from 'node:http'
import type { OutgoingHttpHeaders } from 'node:http'
import type { AddressInfo } from 'node:net'

export type BareAnswers = Record<string, { headers: OutgoingHttpHeaders; bytes: number }>

const answers = new Map(
  Object.entries(JSON.parse(process.env.BARE_ANSWERS ?? '{}') as BareAnswers).map(([path, { headers, bytes }]) => [
    path,
    { headers, body: Buffer.alloc(bytes, 'x') },
  ]),
)
const fallback = { headers: { 'Content-Type': 'application/json' }, body: Buffer.from('{}') }

const server = createServer((req, res) => {
  const { headers, body } = answers.get((req.url ?? '/').split('?')[0]) ?? fallback
  const answer = () => {
    res.writeHead(200, { ...headers, 'Content-Length': body.length })
    res.end(body)
  }
  if (req.method === 'GET') return answer()
  const chunks: Buffer[] = []
  req.on('data', (chunk: Buffer) => chunks.push(chunk))
  req.on('end', () => {
    Buffer.concat(chunks).toString('latin1')
    answer()
  })
})
server.listen(0, '127.0.0.1', () => console.log(`listening ${(server.address() as AddressInfo).port}`))
