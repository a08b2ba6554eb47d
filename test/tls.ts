// A self-signed certificate for a test's own TLS server, made by the openssl command line: the
// tests that serve https (a client site, a proxy) trust it as their only CA.

import { execFile } from 'node:child_process'
import { mkdtemp, readFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { promisify } from 'node:util'

/** Makes a P-256 certificate for `hostname`, valid two days, in a new temporary directory the caller removes. */
export async function makeCertificate(hostname: string): Promise<{ dir: string; key: Buffer; cert: Buffer }> {
  const dir = await mkdtemp(join(tmpdir(), 'latch-tls-'))
  const [keyFile, certFile] = [join(dir, 'key.pem'), join(dir, 'cert.pem')]
  await promisify(execFile)(
    'openssl',
    ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'].concat(
      ['-subj', `/CN=${hostname}`, '-addext', `subjectAltName=DNS:${hostname}`, '-days', '2'],
      ['-keyout', keyFile, '-out', certFile],
    ),
    { timeout: 10_000 },
  )
  return { dir, key: await readFile(keyFile), cert: await readFile(certFile) }
}
