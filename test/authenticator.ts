// A software authenticator for tests, on node:crypto only: it makes a passkey (a key pair and a
// credential ID) and answers a relying party's challenges the way a browser and an authenticator
// would together, with the bytes WebAuthn Level 3 defines. Every answer can be tampered with, so
// that a test can show the relying party refusing it.
//
// What goes over the wire:
// - Registration (navigator.credentials.create) returns `clientDataJSON`, the JSON the browser
//   wrote (type "webauthn.create", the challenge, the page's origin), and `attestationObject`, a
//   CBOR map {fmt, attStmt, authData}. Here fmt is "none" and attStmt is empty (§8.7).
// - authData (§6.1) is: sha256(rpId) (32 bytes), one byte of flags, a 32-bit big-endian signature
//   counter, and on registration the attested credential data: aaguid (16 bytes), the credential
//   ID's length (2 bytes) and the ID, then the credential public key as a COSE_Key (RFC 9052 §7).
// - Authentication (navigator.credentials.get) returns `clientDataJSON` (type "webauthn.get"),
//   `authenticatorData` (authData without the credential), `signature` over
//   authenticatorData || sha256(clientDataJSON), and `userHandle`, the user.id of registration.

import { createHash, generateKeyPairSync, randomBytes, sign } from 'node:crypto'
import type { KeyObject } from 'node:crypto'

// --- CBOR (RFC 8949), the encoding side only --------------------------------------------

/** What the encoder writes: the few CBOR types WebAuthn uses. */
export type CborValue =
  number | bigint | string | boolean | null | undefined | Uint8Array | CborValue[] | Map<number | string, CborValue>

/**
 * Encodes a value as CBOR, in the preferred (shortest) form of RFC 8949 §4.2.1: definite lengths
 * only, map entries in the order given. Integers are numbers or, beyond 2^53, bigints.
 */
export function encodeCbor(value: CborValue): Buffer {
  if (typeof value === 'number' || typeof value === 'bigint') {
    if (typeof value === 'number' && !Number.isSafeInteger(value)) throw new Error(`not an integer: ${value}`)
    const n = BigInt(value)
    // major type 0 is an unsigned integer n, major type 1 a negative integer -1 - n
    return n >= 0n ? head(0, n) : head(1, -1n - n)
  }
  if (value instanceof Uint8Array) return Buffer.concat([head(2, value.length), value])
  if (typeof value === 'string') {
    const utf8 = Buffer.from(value, 'utf8')
    return Buffer.concat([head(3, utf8.length), utf8])
  }
  if (Array.isArray(value)) return Buffer.concat([head(4, value.length), ...value.map(encodeCbor)])
  if (value instanceof Map) {
    const entries = [...value].flatMap(([key, item]) => [encodeCbor(key), encodeCbor(item)])
    return Buffer.concat([head(5, value.size), ...entries])
  }
  // major type 7, simple values: false 20, true 21, null 22, undefined 23
  if (value === false) return Buffer.from([0xf4])
  if (value === true) return Buffer.from([0xf5])
  if (value === null) return Buffer.from([0xf6])
  return Buffer.from([0xf7])
}

/**
 * The initial byte of a data item, and its argument: the major type in the top 3 bits; in the low
 * 5 bits the argument itself when below 24, else 24, 25, 26 or 27 for an argument of 1, 2, 4 or 8
 * bytes that follows.
 */
function head(majorType: number, argument: number | bigint): Buffer {
  const n = BigInt(argument)
  const type = majorType << 5
  if (n < 24n) return Buffer.from([type | Number(n)])
  if (n < 0x100n) return Buffer.from([type | 24, Number(n)])
  if (n < 0x10000n) {
    const bytes = Buffer.alloc(3)
    bytes[0] = type | 25
    bytes.writeUInt16BE(Number(n), 1)
    return bytes
  }
  if (n < 0x100000000n) {
    const bytes = Buffer.alloc(5)
    bytes[0] = type | 26
    bytes.writeUInt32BE(Number(n), 1)
    return bytes
  }
  const bytes = Buffer.alloc(9)
  bytes[0] = type | 27
  bytes.writeBigUInt64BE(n, 1)
  return bytes
}

// --- Credentials ----------------------------------------------------------------------------

/** COSE algorithm identifiers (IANA COSE Algorithms registry). */
export const ES256 = -7
export const EDDSA = -8
export const RS256 = -257

/** The bits of the authenticator data flags byte (WebAuthn L3 §6.1). */
export const FLAGS = {
  /** User Present: someone touched or clicked. */
  UP: 0x01,
  /** User Verified: by PIN, fingerprint, face. */
  UV: 0x04,
  /** Backup Eligible: the key may be synced to other devices. */
  BE: 0x08,
  /** Backed Up: it is synced now (only meaningful with BE). */
  BS: 0x10,
  /** Attested credential data follows the counter (registration). */
  AT: 0x40,
  /** Extension data follows. */
  ED: 0x80,
}

/** A passkey as the authenticator keeps it. */
export type Credential = {
  id: Buffer
  algorithm: number
  privateKey: KeyObject
  publicKey: KeyObject
  /** The signature counter: the last value sent. */
  counter: number
  /** user.id of the registration, returned as userHandle on authentication. */
  userHandle: Buffer
}

/** Makes a new passkey: a P-256 key for ES256, an Ed25519 key for EdDSA, a 2048-bit RSA key for RS256. */
export function createCredential(algorithm: number = ES256, id: Buffer = randomBytes(16)): Credential {
  const pair =
    algorithm === ES256
      ? generateKeyPairSync('ec', { namedCurve: 'P-256' })
      : algorithm === EDDSA
        ? generateKeyPairSync('ed25519')
        : algorithm === RS256
          ? generateKeyPairSync('rsa', { modulusLength: 2048 })
          : undefined
  if (pair === undefined) throw new Error(`no key type for COSE algorithm ${algorithm}`)
  return { id, algorithm, ...pair, counter: 0, userHandle: Buffer.alloc(0) }
}

/**
 * The credential public key as a COSE_Key map (RFC 9052 §7, RFC 9053 §7 and RFC 8230 §4):
 * 1 kty, 3 alg, then per key type EC2 (-1 crv, -2 x, -3 y), OKP (-1 crv, -2 x) or RSA (-1 n, -2 e).
 * `algorithm` replaces the alg label, to show a relying party an algorithm it does not accept.
 */
export function coseKey(credential: Credential, algorithm = credential.algorithm): Map<number, CborValue> {
  const jwk = credential.publicKey.export({ format: 'jwk' })
  const bytes = (base64url: string | undefined) => Buffer.from(base64url ?? '', 'base64url')
  if (credential.algorithm === ES256) {
    // kty 2 (EC2), crv 1 (P-256), x and y: 32 bytes each
    return new Map<number, CborValue>([
      [1, 2],
      [3, algorithm],
      [-1, 1],
      [-2, bytes(jwk.x)],
      [-3, bytes(jwk.y)],
    ])
  }
  if (credential.algorithm === EDDSA) {
    // kty 1 (OKP), crv 6 (Ed25519), x: the 32-byte public key
    return new Map<number, CborValue>([
      [1, 1],
      [3, algorithm],
      [-1, 6],
      [-2, bytes(jwk.x)],
    ])
  }
  // kty 3 (RSA), n the modulus and e the exponent, big-endian without leading zeros
  return new Map<number, CborValue>([
    [1, 3],
    [3, algorithm],
    [-1, bytes(jwk.n)],
    [-2, bytes(jwk.e)],
  ])
}

// --- The bytes of a response ------------------------------------------------------------------

/** clientDataJSON (WebAuthn L3 §5.8.1), its members in the order browsers write them. */
export function clientData(
  fields: Pick<CeremonyOptions, 'challenge' | 'origin' | 'crossOrigin' | 'bom'> & { type: string },
): Buffer {
  const json = JSON.stringify({
    type: fields.type,
    challenge: fields.challenge,
    origin: fields.origin,
    crossOrigin: fields.crossOrigin ?? false,
  })
  return Buffer.from(fields.bom ? `\ufeff${json}` : json)
}

/** Authenticator data (§6.1): rpIdHash, flags, counter, and the attested credential data when given. */
export function authenticatorData(fields: {
  rpId: string
  flags: number
  counter: number
  attested?: { aaguid: Buffer; id: Buffer; publicKey: Map<number, CborValue> }
}): Buffer {
  const counter = Buffer.alloc(4)
  counter.writeUInt32BE(fields.counter)
  const parts = [sha256(Buffer.from(fields.rpId)), Buffer.from([fields.flags]), counter]
  if (fields.attested !== undefined) {
    const length = Buffer.alloc(2)
    length.writeUInt16BE(fields.attested.id.length)
    parts.push(fields.attested.aaguid, length, fields.attested.id, encodeCbor(fields.attested.publicKey))
  }
  return Buffer.concat(parts)
}

/**
 * Signs with the credential's private key: ES256 is ECDSA P-256 with SHA-256, DER-encoded (node's
 * default for an EC key); EdDSA is Ed25519 over the message itself; RS256 is RSASSA-PKCS1-v1_5
 * with SHA-256 (node's default padding for an RSA key).
 */
export function signWith(credential: Credential, data: Buffer): Buffer {
  return sign(credential.algorithm === EDDSA ? null : 'sha256', data, credential.privateKey)
}

export function sha256(data: Buffer): Buffer {
  return createHash('sha256').update(data).digest()
}

// --- Ceremonies -------------------------------------------------------------------------------

/** What the relying party asked, and what a test changes in the answer. */
export type CeremonyOptions = {
  /** The challenge as the relying party sent it: base64url. */
  challenge: string
  /** The origin the browser writes into clientDataJSON. */
  origin: string
  /** The RP ID whose sha256 the authenticator writes into the authenticator data. */
  rpId: string
  /** The whole flags byte; by default UP and UV (and AT on registration). */
  flags?: number
  /** The signature counter; by default 0 on registration, the credential's last one plus 1 after. */
  counter?: number
  /** clientDataJSON's type; by default "webauthn.create" or "webauthn.get". */
  type?: string
  crossOrigin?: boolean
  /** Whether clientDataJSON begins with a byte order mark, which the relying party must pass over. */
  bom?: boolean
}

export type RegistrationResponse = {
  /** The credential ID, base64url. */
  id: string
  clientDataJSON: Buffer
  attestationObject: Buffer
}

/**
 * Answers navigator.credentials.create(): attestation "none", so nothing but the authenticator
 * data says where the key came from. `algorithm` replaces the alg of the COSE key; `userHandle` is
 * kept for authentications, as user.id is.
 */
export function register(
  credential: Credential,
  options: CeremonyOptions & { algorithm?: number; userHandle?: Buffer },
): RegistrationResponse {
  const flags = options.flags ?? FLAGS.UP | FLAGS.UV | FLAGS.AT
  const counter = options.counter ?? 0
  const authData = authenticatorData({
    rpId: options.rpId,
    flags,
    counter,
    // attested credential data goes with the AT flag; an authenticator without an AAGUID sends zeros
    attested:
      flags & FLAGS.AT
        ? { aaguid: Buffer.alloc(16), id: credential.id, publicKey: coseKey(credential, options.algorithm) }
        : undefined,
  })
  credential.counter = counter
  if (options.userHandle !== undefined) credential.userHandle = options.userHandle
  const attestationObject = encodeCbor(
    new Map<string, CborValue>([
      ['fmt', 'none'],
      ['attStmt', new Map()],
      ['authData', authData],
    ]),
  )
  const clientDataJSON = clientData({
    type: options.type ?? 'webauthn.create',
    challenge: options.challenge,
    origin: options.origin,
    crossOrigin: options.crossOrigin,
    bom: options.bom,
  })
  return { id: credential.id.toString('base64url'), clientDataJSON, attestationObject }
}

export type AuthenticationResponse = {
  id: string
  clientDataJSON: Buffer
  authenticatorData: Buffer
  signature: Buffer
  userHandle: Buffer
}

/** Answers navigator.credentials.get(): signs authenticatorData || sha256(clientDataJSON). */
export function authenticate(credential: Credential, options: CeremonyOptions): AuthenticationResponse {
  const counter = options.counter ?? credential.counter + 1
  credential.counter = counter
  const clientDataJSON = clientData({
    type: options.type ?? 'webauthn.get',
    challenge: options.challenge,
    origin: options.origin,
    crossOrigin: options.crossOrigin,
    bom: options.bom,
  })
  const authData = authenticatorData({ rpId: options.rpId, flags: options.flags ?? FLAGS.UP | FLAGS.UV, counter })
  const signature = signWith(credential, Buffer.concat([authData, sha256(clientDataJSON)]))
  return {
    id: credential.id.toString('base64url'),
    clientDataJSON,
    authenticatorData: authData,
    signature,
    userHandle: credential.userHandle,
  }
}
