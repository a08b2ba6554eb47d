// The limit: a bare node:http server answering the same request shapes as Latch, with nothing
// else. A POST reads its whole form body and answers a small JSON; a GET answers an HTML page as
// large as Latch's consent page (BARE_PAGE_BYTES). Prints `listening <port>` once it listens.

import { createServer } from 'node:http'
import type { AddressInfo } from 'node:net'

const page = Buffer.from(`<!doctype html><title>bare</title>${'x'.repeat(Math.max(0, Number(process.env.BARE_PAGE_BYTES ?? 4096) - 34))}`)
const json = Buffer.from(JSON.stringify({ active: true, me: 'http://127.0.0.1:3000/', scope: 'profile create', client_id: 'http://127.0.0.1:8080/', exp: 1800000000, iat: 1790000000 }))

const server = createServer((req, res) => {
  if (req.method === 'GET') {
    res.writeHead(200, { 'Content-Type': 'text/html; charset=utf-8', 'Content-Length': page.length })
    res.end(page)
    return
  }
  const chunks: Buffer[] = []
  req.on('data', (chunk: Buffer) => chunks.push(chunk))
  req.on('end', () => {
    Buffer.concat(chunks).toString('latin1')
    res.writeHead(200, { 'Content-Type': 'application/json', 'Content-Length': json.length })
    res.end(json)
  })
})
server.listen(0, '127.0.0.1', () => console.log(`listening ${(server.address() as AddressInfo).port}`))
