// Passkeys (WebAuthn Level 3) at Latch: the CBOR and COSE readers, the registration and
// authentication checks of §7.1 and §7.2, first on the specification's own test vectors, then on
// the answers of a software authenticator (test/authenticator.ts) with one thing wrong at a time,
// and over HTTP: a passkey added after a password sign-in, a sign-in with it, and the ways a
// sign-in is refused (a replayed, foreign, cloned or expired answer), throttling, and the
// Content-Security-Policy of the pages that carry the passkey script.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { createHash, createPublicKey, generateKeyPairSync, randomBytes, sign, verify } from 'node:crypto'
import {
  FileStore,
  MemoryStore,
  PasskeyError,
  hashPassword,
  hashSecret,
  readAuthenticatorData,
  readCbor,
  readCoseKey,
  verifyAuthentication,
  verifyRegistration,
} from '../server.ts'
import {
  EDDSA,
  ES256,
  FLAGS,
  RS256,
  authenticate,
  authenticatorData as authenticatorDataOf,
  coseKey,
  createCredential,
  encodeCbor,
  register,
  sha256,
  signWith,
} from './authenticator.ts'
import type { Passkey, Store } from '../server.ts'
import type { CborValue, Credential } from './authenticator.ts'
import { startLatch as startTestLatch } from './harness.ts'
import { mkdtemp } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import type { TestServer } from './harness.ts'

// --- Helpers ----------------------------------------------------------------------------

/** Hex written over several lines: whitespace is ignored. */
function hex(text: TemplateStringsArray): Buffer {
  const digits = text.raw.join('').replace(/\s+/g, '')
  assert.match(digits, /^(?:[0-9a-f]{2})*$/)
  return Buffer.from(digits, 'hex')
}

/** Asserts that `run` throws a PasskeyError, whose message matches `message` when given. */
function refuses(run: () => unknown, message?: RegExp): void {
  assert.throws(run, (error: unknown) => {
    assert.ok(error instanceof PasskeyError, `expected a PasskeyError, got ${String(error)}`)
    if (message !== undefined) assert.match(error.message, message)
    return true
  })
}

/** What Latch says when the authenticator did not verify the user (the UV flag). */
const NO_UV = /did not verify the person/

/** What Latch says when clientDataJSON has crossOrigin true. */
const CROSS_ORIGIN = /frame of another origin/

function base64url(bytes: Buffer): string {
  return bytes.toString('base64url')
}

/** The SubjectPublicKeyInfo of a key, base64url: how Latch stores a passkey's public key. */
function spki(key: Credential['publicKey']): string {
  return base64url(key.export({ type: 'spki', format: 'der' }))
}

// --- 1. The WebAuthn Level 3 test vectors -----------------------------------------------

// Copied from W3C "Web Authentication: An API for accessing Public Key Credentials - Level 3",
// section "Test Vectors" (#sctn-test-vectors), byte for byte. Each has a registration (clientDataJSON
// and attestationObject for its challenge) and an authentication with the same credential. They
// use the RP ID example.org and the origin https://example.org. The flags byte of each is random
// (derived by HKDF from 'WebAuthn test vectors'), so some lack UV, which Latch requires; those
// are refused for that reason, and the rest of each is checked apart from it.
const VECTORS = {
  // "Packed Attestation with ES256 Credential" (#sctn-test-vectors-packed-es256)
  packedEs256: {
    registration: {
      challenge: hex`c1184a5fddf8045e13dc47f54b61f5a656b666b59018f16d870e9256e9952012`,
      credentialId: hex`c9a6f5b3462d02873fea0c56862234f99f081728084e511bb7760201a89054a5`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e637265617465222c226368616c6c656e6765223a227752684b5839333442
        4634543345663153324831706c61325a725751475046746877365356756d56494249222c226f726967696e223a226874
        7470733a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73652c226578747261446174
        61223a22636c69656e74446174614a534f4e206d617920626520657874656e6465642077697468206164646974696f6e
        616c206669656c647320696e20746865206675747572652c207375636820617320746869733a20396138624e596a4b43
        6757724258552d66436c316167227d
      `,
      attestationObject: hex`
        a363666d74667061636b65646761747453746d74a363616c6726637369675847304502203f19ec4b229f46ab8c45eff2
        9b904ff10c0390dc40bf1216f04a78f4ceba3425022100fe7041a32759aff05a0f9f26c70a999c7a284451ba89234a1d
        3483c25e21925b637835638159022530820221308201c8a00302010202110088c220f83c8ef1feafe94deae45faad030
        0a06082a8648ce3d0403023062311e301c06035504030c15576562417574686e207465737420766563746f7273310c30
        0a060355040a0c0357334331253023060355040b0c1c41757468656e74696361746f72204174746573746174696f6e20
        4341310b30090603550406130241413020170d3234303130313030303030305a180f3330323430313031303030303030
        5a305f311e301c06035504030c15576562417574686e207465737420766563746f7273310c300a060355040a0c035733
        4331223020060355040b0c1941757468656e74696361746f72204174746573746174696f6e310b300906035504061302
        41413059301306072a8648ce3d020106082a8648ce3d03010703420004a91ba4389409dd38a428141940ca8feb1ac0d7
        b4350558104a3777a49322f3798440f378b3398ab2d3bb7bf91322c92eb23556f59ad0a836fec4c7663b0e4dc3a36030
        5e300c0603551d130101ff04023000300e0603551d0f0101ff040403020780301d0603551d0e04160414a589ba72d060
        842ab11f74fb246bdedab16f9b9b301f0603551d2304183016801445aff715b0dd786741fee996ebc16547a3931b1e30
        0a06082a8648ce3d040302034700304402201726b9d85ecd8a5ed51163722ca3a20886fd9b242a0aa0453d442116075d
        efd502207ef471e530ac87961a88a7f0d0c17b091ffc6b9238d30f79f635b417be5910e768617574684461746158a4bf
        abc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b54d00000000876ca4f52071c3e9b25509ef
        2cdf7ed60020c9a6f5b3462d02873fea0c56862234f99f081728084e511bb7760201a89054a5a5010203262001215820
        1cf27f25da591208a4239c2e324f104f585525479a29edeedd830f48e77aeae522582059e4b7da6c0106e206ce390c93
        ab98a15a5ec3887e57f0cc2bece803b920c423
      `,
    },
    authentication: {
      challenge: hex`b1106fa46a57bef1781511c0557dc898a03413d5f0f17d244630c194c7e1adb5`,
      authenticatorData: hex`bfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b50d00000000`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e676574222c226368616c6c656e6765223a22735242767047705876764634
        46524841565833496d4b4130453958773858306b526a44426c4d6668726255222c226f726967696e223a226874747073
        3a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73652c22657874726144617461223a
        22636c69656e74446174614a534f4e206d617920626520657874656e6465642077697468206164646974696f6e616c20
        6669656c647320696e20746865206675747572652c207375636820617320746869733a20415a4d77794d78496244382d
        756775464e7036723851227d
      `,
      signature: hex`
        30450220694969d3ee928de6f02ef23a9c644d7d779916451734a94b432542f498a1ebe90221008b0819c824218a9715
        2cd099c55bfb1477b29d900a49a64018314f9bfccda163
      `,
    },
  },
  // "ES256 Credential with No Attestation" (#sctn-test-vectors-none-es256)
  noneEs256: {
    registration: {
      challenge: hex`00c30fb78531c464d2b6771dab8d7b603c01162f2fa486bea70f283ae556e130`,
      credentialId: hex`f91f391db4c9b2fde0ea70189cba3fb63f579ba6122b33ad94ff3ec330084be4`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e637265617465222c226368616c6c656e6765223a22414d4d507434557878
        475453746e63647134313759447742466938767049612d7077386f4f755657345441222c226f726967696e223a226874
        7470733a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73652c226578747261446174
        61223a22636c69656e74446174614a534f4e206d617920626520657874656e6465642077697468206164646974696f6e
        616c206669656c647320696e20746865206675747572652c207375636820617320746869733a20426b5165446a646354
        427258426941774a544c453551227d
      `,
      attestationObject: hex`
        a363666d74646e6f6e656761747453746d74a068617574684461746158a4bfabc37432958b063360d3ad6461c9c4735a
        e7f8edd46592a5e0f01452b2e4b559000000008446ccb9ab1db374750b2367ff6f3a1f0020f91f391db4c9b2fde0ea70
        189cba3fb63f579ba6122b33ad94ff3ec330084be4a5010203262001215820afefa16f97ca9b2d23eb86ccb64098d20d
        b90856062eb249c33a9b672f26df61225820930a56b87a2fca66334b03458abf879717c12cc68ed73290af2e2664796b
        9220
      `,
    },
    authentication: {
      challenge: hex`39c0e7521417ba54d43e8dc95174f423dee9bf3cd804ff6d65c857c9abf4d408`,
      authenticatorData: hex`bfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b51900000000`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e676574222c226368616c6c656e6765223a224f63446e55685158756c5455
        506f334a5558543049393770767a7a59425039745a63685879617630314167222c226f726967696e223a226874747073
        3a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73657d
      `,
      signature: hex`
        3046022100f50a4e2e4409249c4a853ba361282f09841df4dd4547a13a87780218deffcd380221008480ac0f0b935381
        74f575bf11a1dd5d78c6e486013f937295ea13653e331e87
      `,
    },
  },
  // "ES256 Credential with \"crossOrigin\": true in clientDataJSON" (#sctn-test-vectors-none-es256-crossOrigin)
  crossOrigin: {
    registration: {
      challenge: hex`3be5aacd03537142472340ab5969f240f1d87716e20b6807ac230655fa4b3b49`,
      credentialId: hex`6e1050c0d2ca2f07c755cb2c66a74c64fa43065c18f938354d9915db2bd5ce57`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e637265617465222c226368616c6c656e6765223a224f2d57717a514e5463
        554a484930437257576e7951504859647862694332674872434d475666704c4f306b222c226f726967696e223a226874
        7470733a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a747275652c22657874726144617461
        223a22636c69656e74446174614a534f4e206d617920626520657874656e6465642077697468206164646974696f6e61
        6c206669656c647320696e20746865206675747572652c207375636820617320746869733a207a5a7175457444523944
        577170573574425754467567227d
      `,
      attestationObject: hex`
        a363666d74646e6f6e656761747453746d74a068617574684461746158a4bfabc37432958b063360d3ad6461c9c4735a
        e7f8edd46592a5e0f01452b2e4b54500000000883f4f6014f19c09d87aa38123be48d000206e1050c0d2ca2f07c755cb
        2c66a74c64fa43065c18f938354d9915db2bd5ce57a501020326200121582022200a473f90b11078851550d03b4e44a2
        279f8c4eca27b3153dedfe03e4e97d225820cbd0be95e746ad6f5a8191be11756e4c0420e72f65b466d39bc56b8b123a
        9c6e
      `,
    },
    authentication: {
      challenge: hex`876aa517ba83fdee65fcffdbca4c84eeae5d54f8041a1fc85c991e5bbb273137`,
      authenticatorData: hex`bfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b50500000000`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e676574222c226368616c6c656e6765223a226832716c463771445f65356c
        5f505f62796b7945377135645650674547685f49584a6b655737736e4d5463222c226f726967696e223a226874747073
        3a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a747275652c22657874726144617461223a22
        636c69656e74446174614a534f4e206d617920626520657874656e6465642077697468206164646974696f6e616c2066
        69656c647320696e20746865206675747572652c207375636820617320746869733a2039327063545644304162792d71
        3464746d6a36656667227d
      `,
      signature: hex`
        3046022100eb12fcf23b12764c0f122e22371fab92e283879fd798f38ee1841c951b6e40e7022100c76237ff9db77b3c
        56f30837cda6a09acfa2e915544e609c0733b1184036d1cf
      `,
    },
  },
  // "Packed Attestation with RS256 Credential" (#sctn-test-vectors-packed-rs256)
  packedRs256: {
    registration: {
      challenge: hex`bea8f0770009bd57f2c0df6fea9f743a27e4b61bbe923c862c7aad7a9fc8e4a6`,
      credentialId: hex`992a18acc83f67533600c1138a4b4c4bd236de13629cf025ed17cb00b00b74df`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e637265617465222c226368616c6c656e6765223a2276716a776477414a76
        566679774e3976367039304f69666b7468752d6b6a79474c48717465705f49354b59222c226f726967696e223a226874
        7470733a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73657d
      `,
      attestationObject: hex`
        a363666d74667061636b65646761747453746d74a363616c672663736967584730450221008b8c5c6ea8c142c032e0be
        69e1353d44461c5c9109941cdda951b976eb95b6b302204d52f406c19e254b3ff9589bd18070fb055ac8db12fdd0a673
        4bea9d7168e900637835638159022630820222308201c7a00302010202101f6fb7a5ece81b45896b983a995da5f3300a
        06082a8648ce3d0403023062311e301c06035504030c15576562417574686e207465737420766563746f7273310c300a
        060355040a0c0357334331253023060355040b0c1c41757468656e74696361746f72204174746573746174696f6e2043
        41310b30090603550406130241413020170d3234303130313030303030305a180f33303234303130313030303030305a
        305f311e301c06035504030c15576562417574686e207465737420766563746f7273310c300a060355040a0c03573343
        31223020060355040b0c1941757468656e74696361746f72204174746573746174696f6e310b30090603550406130241
        413059301306072a8648ce3d020106082a8648ce3d03010703420004b7b36b7542a11120b443c794d0c99fdc25a06b76
        586413d81e086163ef6fe147a557afc34e2861d9057d6d465d4705a0310550bdeeb5f35ee35b9425ab859981a360305e
        300c0603551d130101ff04023000300e0603551d0f0101ff040403020780301d0603551d0e04160414fb37b647bccfb9
        e54d989eaaacc1633868703fb3301f0603551d2304183016801445aff715b0dd786741fee996ebc16547a3931b1e300a
        06082a8648ce3d0403020349003046022100b86bc129d92afca7d9869a39f70f139a305b4073a39eb654d81424bed575
        7d91022100cf9f7c60cab7c4a7d3e7f0020f281a93d4fd0a9f95121b989f56932a68885fba6861757468446174615902
        1bbfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b55d00000000428f8878298b9862a36a
        d8c7527bfef20020992a18acc83f67533600c1138a4b4c4bd236de13629cf025ed17cb00b00b74dfa401030339010020
        5901b403ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff
        ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff
        ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff
        fffffffffffffffffffffffffffffffffffffff7ffffffffffffffffffffffffffffffffffffffffffffffffffffffff
        ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff
        ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff800000000000000000
        000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000
        000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000
        000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000
        000000000000012143010001
      `,
    },
    authentication: {
      challenge: hex`295f59f5fa8fe62c5aca9e27626c78c8da376ae6d8cd2dd29aebad601e1bc4c5`,
      authenticatorData: hex`bfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b51900000000`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e676574222c226368616c6c656e6765223a224b56395a3966715035697861
        7970346e596d7834794e6f33617562597a5333536d75757459423462784d55222c226f726967696e223a226874747073
        3a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73657d
      `,
      signature: hex`
        01063d52d7c39b4d432fc7063c5d93e582bdcb16889cd71f888d67d880ea730a428498d3bc8e1ee11f2b1ecbe6c292b1
        18c55ffaaddefa8cad0a54dd137c51f1eec673f1bb6c4d1789d6826a222b22d0f585fc901fdc933212e579d199b89d67
        2aa44891333e6a1355536025e82b25590256c3538229b55737083b2f6b9377e49e2472f11952f79fdd0da180b5ffd901
        b4049a8f081bb40711bef76c62aed943571f2d0575304cb549d68d8892f95086a30f93716aee818f8dc06e96c0d5e0ed
        4cfa9fd8773d90464b68cf140f7986666ff9c9e3302acd0535d60d769f465e2ab57ef8aabc89fccfef7ba32a64154a8b
        3d26be2298f470b8cc5377dbe3dfd4b0b45f8f01e63bde6cfc76b62771f9b70aa27cf40152cad93aa5acd784fd4b90f6
        76e2ea828d0bf2400aebbaae4153e5838f537f88b6228346782a93a899be66ec77de45b3efcf311da6321c92e6b0cd11
        bfe653bf3e98cee8e341f02d67dbb6f9c98d9e8178090cfb5b70fbc6d541599ac794ae2f1d4de1286ec8de8c2daf7b1d
        15c8438e90d924df5c19045220a4c8438c1b979bbe016cf3d0eeec23c3999d4882cc645b776de930756612cdc6dd3981
        60ff02a6
      `,
    },
  },
  // "Packed Attestation with Ed25519 Credential" (#sctn-test-vectors-packed-eddsa)
  packedEd25519: {
    registration: {
      challenge: hex`a8abf9dabdc6b0df63466b39bda9e8a34a34e185337a59f1c579990676d3b3bd`,
      credentialId: hex`ce9f840ed96599580cd140fbc7bb3230633f50f61041aff73308ae71caa8a2bd`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e637265617465222c226368616c6c656e6765223a22714b76353272334773
        4e396a526d733576616e6f6f306f303459557a656c6e7878586d5a426e6254733730222c226f726967696e223a226874
        7470733a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73652c226578747261446174
        61223a22636c69656e74446174614a534f4e206d617920626520657874656e6465642077697468206164646974696f6e
        616c206669656c647320696e20746865206675747572652c207375636820617320746869733a20425f44543567375a44
        5f2d394f544c59583549764551227d
      `,
      attestationObject: hex`
        a363666d74667061636b65646761747453746d74a363616c67266373696758483046022100d83f60bd80269537583218
        858aefb03ac57d45fa06e42feaae332d187f62da9f022100a02bd3cb6f7e1d283c93bad1f3f4b5a4c0494463da7fdbf2
        56949116754d1f17637835638159022730820223308201c8a003020102021100b2cfc9ea33c8643b0e1a760463eaf164
        300a06082a8648ce3d0403023062311e301c06035504030c15576562417574686e207465737420766563746f7273310c
        300a060355040a0c0357334331253023060355040b0c1c41757468656e74696361746f72204174746573746174696f6e
        204341310b30090603550406130241413020170d3234303130313030303030305a180f33303234303130313030303030
        305a305f311e301c06035504030c15576562417574686e207465737420766563746f7273310c300a060355040a0c0357
        334331223020060355040b0c1941757468656e74696361746f72204174746573746174696f6e310b3009060355040613
        0241413059301306072a8648ce3d020106082a8648ce3d03010703420004dd2b7a564b73b8c0b81c4c62e521925c4d11
        98ec9f583dbf1eebe364b65cd9c29a9bdf346aaa81fb6b9507e5249a52fdaf8e39e26b0b7dc45992a7e233b70f70a360
        305e300c0603551d130101ff04023000300e0603551d0f0101ff040403020780301d0603551d0e041604140ae27546bc
        7eccb1b4b597bd354f0c0b1f1f8f8e301f0603551d2304183016801445aff715b0dd786741fee996ebc16547a3931b1e
        300a06082a8648ce3d0403020349003046022100a0d434ecb5fc3bfd7da5f41904517ad2836249f561bd834ba7a438a8
        ab7a4ce8022100fac845bb7a02513b58e9f319654dbe49b0f02b95835bac568c71f8a18cdde9ab686175746844617461
        5881bfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b54100000000d5aa33581e8ca478e2
        0fe713f5d32ff20020ce9f840ed96599580cd140fbc7bb3230633f50f61041aff73308ae71caa8a2bda4010103272006
        21582044e06ddd331c36a8dc667bab52bcae63486c916aa5e339e6acebaa84934bf832
      `,
    },
    authentication: {
      challenge: hex`895957e01c633a698348a2d8a31a54b7db27e8c1c43b2080d79ae2190267bfd2`,
      authenticatorData: hex`bfabc37432958b063360d3ad6461c9c4735ae7f8edd46592a5e0f01452b2e4b50100000000`,
      clientDataJSON: hex`
        7b2274797065223a22776562617574686e2e676574222c226368616c6c656e6765223a2269566c583442786a4f6d6d44
        534b4c596f7870557439736e364d48454f7943413135726947514a6e763949222c226f726967696e223a226874747073
        3a2f2f6578616d706c652e6f7267222c2263726f73734f726967696e223a66616c73657d
      `,
      signature: hex`
        f5c59c7e46c34f6f8cc197101ddf9934fa2595f68eb1913a637e8419eb9ba4cfdfc48f85393bc0d40b011f0d6fecb097
        d6607525713223a0dc0d453993dae00b
      `,
    },
  },
}

const EXAMPLE = { origin: 'https://example.org', rpId: 'example.org' }

type Vector = (typeof VECTORS)[keyof typeof VECTORS]

function registrationOf(vector: Vector) {
  return {
    response: {
      clientDataJSON: vector.registration.clientDataJSON,
      attestationObject: vector.registration.attestationObject,
    },
    expected: { challenge: base64url(vector.registration.challenge), ...EXAMPLE },
  }
}

function authenticationOf(vector: Vector, credential: { publicKey: string; algorithm: number; counter: number }) {
  const { authenticatorData, clientDataJSON, signature } = vector.authentication
  return {
    response: { authenticatorData, clientDataJSON, signature },
    expected: { challenge: base64url(vector.authentication.challenge), ...EXAMPLE, ...credential },
  }
}

/**
 * The vector's attestationObject with `flags` added to its authenticator data. Nothing signs the
 * authenticator data of a registration that Latch reads (it ignores attestation statements), so
 * this shows what Latch would do were the flag set.
 */
function withFlags(attestationObject: Buffer, flags: number): Buffer {
  const object = readCbor(attestationObject).value as Map<string, CborValue>
  const authData = Buffer.from(object.get('authData') as Buffer)
  authData[32] |= flags
  return encodeCbor(new Map([...object, ['authData', authData]]))
}

/** Verifies an authentication vector's signature with node:crypto alone, against a SPKI key. */
function signatureHolds(vector: Vector, publicKey: string, algorithm: number): boolean {
  const { authenticatorData, clientDataJSON, signature } = vector.authentication
  const key = createPublicKey({ key: Buffer.from(publicKey, 'base64url'), format: 'der', type: 'spki' })
  const signed = Buffer.concat([authenticatorData, sha256(clientDataJSON)])
  return verify(algorithm === EDDSA ? null : 'sha256', signed, key, signature)
}

describe('WebAuthn Level 3 test vectors', () => {
  it('registers "Packed Attestation with ES256 Credential", ignoring its statement, and verifies its sign-in', () => {
    const vector = VECTORS.packedEs256
    const { response, expected } = registrationOf(vector)
    const credential = verifyRegistration(response, expected)
    assert.equal(credential.id, base64url(vector.registration.credentialId))
    assert.equal(credential.algorithm, ES256)
    assert.equal(credential.counter, 0)
    // the COSE key's x and y, as they appear in the attestationObject
    const jwk = createPublicKey({
      key: Buffer.from(credential.publicKey, 'base64url'),
      format: 'der',
      type: 'spki',
    }).export({ format: 'jwk' })
    assert.equal(jwk.crv, 'P-256')
    assert.equal(jwk.x, base64url(hex`1cf27f25da591208a4239c2e324f104f585525479a29edeedd830f48e77aeae5`))
    assert.equal(jwk.y, base64url(hex`59e4b7da6c0106e206ce390c93ab98a15a5ec3887e57f0cc2bece803b920c423`))
    // its flags (0x0d: UP, UV, BE) and counter 0 after a stored 0: a counter of 0 stays allowed
    const authentication = authenticationOf(vector, credential)
    assert.equal(verifyAuthentication(authentication.response, authentication.expected).counter, 0)
  })

  it('refuses the same ES256 vector for another challenge, origin or RP ID', () => {
    const vector = VECTORS.packedEs256
    const { response, expected } = registrationOf(vector)
    refuses(() => verifyRegistration(response, { ...expected, challenge: base64url(vector.authentication.challenge) }))
    refuses(() => verifyRegistration(response, { ...expected, origin: 'https://example.com' }))
    refuses(() => verifyRegistration(response, { ...expected, rpId: 'example.com' }))
    const credential = verifyRegistration(response, expected)
    const authentication = authenticationOf(vector, credential)
    refuses(() =>
      verifyAuthentication(authentication.response, { ...authentication.expected, challenge: expected.challenge }),
    )
    refuses(() =>
      verifyAuthentication(authentication.response, { ...authentication.expected, origin: 'http://example.org' }),
    )
    refuses(() =>
      verifyAuthentication(authentication.response, { ...authentication.expected, rpId: 'sub.example.org' }),
    )
  })

  it('reads the authenticator data of the ES256 vector: rpIdHash, flags, counter and credential', () => {
    const vector = VECTORS.packedEs256
    const object = readCbor(vector.registration.attestationObject).value as Map<string, unknown>
    const data = readAuthenticatorData(object.get('authData') as Buffer)
    assert.deepEqual(data.rpIdHash, sha256(Buffer.from('example.org')))
    assert.deepEqual(data.flags, { userPresent: true, userVerified: true, backupEligible: true, backedUp: false })
    assert.equal(data.counter, 0)
    assert.deepEqual(data.credential?.aaguid, hex`876ca4f52071c3e9b25509ef2cdf7ed6`)
    assert.deepEqual(data.credential?.id, vector.registration.credentialId)
    assert.equal(readCoseKey(data.credential?.publicKey).algorithm, ES256)
  })

  it('registers "Packed Attestation with RS256 Credential"; its sign-in lacks UV (flags 0x19) and is refused', () => {
    const vector = VECTORS.packedRs256
    const { response, expected } = registrationOf(vector)
    const credential = verifyRegistration(response, expected) // flags 0x5d: UP, UV, BE, BS, AT
    assert.equal(credential.id, base64url(vector.registration.credentialId))
    assert.equal(credential.algorithm, RS256)
    // the modulus is the product of the Mersenne primes 2^1279 - 1 and 2^2203 - 1, as the section says
    const jwk = createPublicKey({
      key: Buffer.from(credential.publicKey, 'base64url'),
      format: 'der',
      type: 'spki',
    }).export({ format: 'jwk' })
    const modulus = ((1n << 1279n) - 1n) * ((1n << 2203n) - 1n)
    assert.equal(BigInt(`0x${Buffer.from(jwk.n ?? '', 'base64url').toString('hex')}`), modulus)
    assert.equal(jwk.e, 'AQAB')
    const authentication = authenticationOf(vector, credential)
    assert.equal(vector.authentication.authenticatorData[32], FLAGS.UP | FLAGS.BE | FLAGS.BS)
    refuses(() => verifyAuthentication(authentication.response, authentication.expected), NO_UV)
    assert.ok(signatureHolds(vector, credential.publicKey, RS256)) // so UV is all that is wrong with it
  })

  it('refuses "ES256 Credential with No Attestation" for its missing UV (0x59, then 0x19), and nothing else', () => {
    const vector = VECTORS.noneEs256
    const { response, expected } = registrationOf(vector)
    refuses(() => verifyRegistration(response, expected), NO_UV)
    const attestationObject = withFlags(response.attestationObject, FLAGS.UV)
    const credential = verifyRegistration({ ...response, attestationObject }, expected)
    assert.equal(credential.id, base64url(vector.registration.credentialId))
    assert.equal(credential.algorithm, ES256)
    const authentication = authenticationOf(vector, credential)
    refuses(() => verifyAuthentication(authentication.response, authentication.expected), NO_UV)
    assert.ok(signatureHolds(vector, credential.publicKey, ES256))
  })

  it('refuses "Packed Attestation with Ed25519 Credential" for its missing UV (0x41, 0x01) alone', () => {
    const vector = VECTORS.packedEd25519
    const { response, expected } = registrationOf(vector)
    refuses(() => verifyRegistration(response, expected), NO_UV)
    const attestationObject = withFlags(response.attestationObject, FLAGS.UV)
    const credential = verifyRegistration({ ...response, attestationObject }, expected)
    assert.equal(credential.id, base64url(vector.registration.credentialId))
    assert.equal(credential.algorithm, EDDSA)
    const jwk = createPublicKey({
      key: Buffer.from(credential.publicKey, 'base64url'),
      format: 'der',
      type: 'spki',
    }).export({ format: 'jwk' })
    assert.equal(jwk.x, base64url(hex`44e06ddd331c36a8dc667bab52bcae63486c916aa5e339e6acebaa84934bf832`))
    const authentication = authenticationOf(vector, credential)
    refuses(() => verifyAuthentication(authentication.response, authentication.expected), NO_UV)
    assert.ok(signatureHolds(vector, credential.publicKey, EDDSA))
  })

  it('refuses "ES256 Credential with "crossOrigin": true" as cross-origin, its UV set (0x45, 0x05)', () => {
    const vector = VECTORS.crossOrigin
    const { response, expected } = registrationOf(vector)
    refuses(() => verifyRegistration(response, expected), CROSS_ORIGIN)
    // the credential public key, read from the vector's own authenticator data
    const object = readCbor(response.attestationObject).value as Map<string, unknown>
    const data = readAuthenticatorData(object.get('authData') as Buffer)
    const { key, algorithm } = readCoseKey(data.credential?.publicKey)
    const credential = { publicKey: spki(key), algorithm, counter: 0 }
    const authentication = authenticationOf(vector, credential)
    refuses(() => verifyAuthentication(authentication.response, authentication.expected), CROSS_ORIGIN)
    assert.ok(signatureHolds(vector, credential.publicKey, ES256))
  })
})

// --- 2. readCbor ----------------------------------------------------------------------------

/** Reads one data item that spans the whole input. */
function decode(hexText: string): unknown {
  const bytes = Buffer.from(hexText.replace(/\s+/g, ''), 'hex')
  const { value, end } = readCbor(bytes)
  assert.equal(end, bytes.length, hexText)
  return value
}

describe('readCbor', () => {
  it('reads the integers of RFC 8949 Appendix A', () => {
    const examples: [string, number][] = [
      ['00', 0],
      ['01', 1],
      ['0a', 10],
      ['17', 23],
      ['1818', 24],
      ['1819', 25],
      ['1864', 100],
      ['1903e8', 1000],
      ['1a000f4240', 1000000],
      ['1b000000e8d4a51000', 1000000000000],
      ['20', -1],
      ['29', -10],
      ['3863', -100],
      ['3903e7', -1000],
    ]
    for (const [bytes, value] of examples) assert.equal(decode(bytes), value, bytes)
  })

  it('reads 64-bit integers up to 2^53 - 1 and down to -(2^53)', () => {
    assert.equal(decode('1b001fffffffffffff'), Number.MAX_SAFE_INTEGER)
    assert.equal(decode('3b001fffffffffffff'), -(2 ** 53))
  })

  it('reads byte and text strings, arrays, maps and simple values', () => {
    assert.deepEqual(decode('40'), Buffer.alloc(0))
    assert.deepEqual(decode('4401020304'), Buffer.from([1, 2, 3, 4]))
    assert.equal(decode('60'), '')
    assert.equal(decode('6161'), 'a')
    assert.equal(decode('6449455446'), 'IETF')
    assert.equal(decode('62225c'), '"\\')
    assert.equal(decode('62c3bc'), '\u00fc')
    assert.equal(decode('63e6b0b4'), '\u6c34')
    assert.deepEqual(decode('80'), [])
    assert.deepEqual(decode('83010203'), [1, 2, 3])
    assert.deepEqual(decode('8301820203820405'), [1, [2, 3], [4, 5]])
    const twentyFive = Array.from({ length: 25 }, (_, i) => i + 1)
    assert.deepEqual(decode('98190102030405060708090a0b0c0d0e0f101112131415161718181819'), twentyFive)
    assert.deepEqual(decode('a0'), new Map())
    assert.deepEqual(
      decode('a201020304'),
      new Map([
        [1, 2],
        [3, 4],
      ]),
    )
    assert.deepEqual(
      decode('a26161016162820203'),
      new Map<unknown, unknown>([
        ['a', 1],
        ['b', [2, 3]],
      ]),
    )
    assert.deepEqual(decode('826161a161626163'), ['a', new Map([['b', 'c']])])
    assert.equal(decode('f4'), false)
    assert.equal(decode('f5'), true)
    assert.equal(decode('f6'), null)
  })

  it('reads one item at the offset given, and says where it ends', () => {
    assert.deepEqual(readCbor(Buffer.from('00011903e8', 'hex'), 2), { value: 1000, end: 5 })
    assert.deepEqual(readCbor(Buffer.from('0102', 'hex')), { value: 1, end: 1 })
  })

  it('reads nesting 16 deep', () => {
    let nested: unknown = 0
    for (let i = 0; i < 16; i++) nested = [nested]
    assert.deepEqual(decode(`${'81'.repeat(16)}00`), nested)
  })

  it('refuses indefinite lengths', () => {
    refuses(() => readCbor(Buffer.from('5f42010243030405ff', 'hex')))
    refuses(() => readCbor(Buffer.from('7f657374726561646d696e67ff', 'hex')))
    refuses(() => readCbor(Buffer.from('9fff', 'hex')))
    refuses(() => readCbor(Buffer.from('9f018202039f0405ffff', 'hex')))
    refuses(() => readCbor(Buffer.from('bf61610161629f0203ffff', 'hex')))
  })

  it('names reserved additional information (28 to 30) as such, not as an indefinite length', () => {
    for (const initial of ['1c', '3d', '5e', '9e', 'bc'])
      assert.throws(() => readCbor(Buffer.from(`${initial}00`, 'hex')), /reserved/)
    assert.throws(() => readCbor(Buffer.from('5f42010243030405ff', 'hex')), /indefinite/)
  })

  it('refuses tags', () => {
    refuses(() => readCbor(Buffer.from('c074323031332d30332d32315432303a30343a30305a', 'hex')))
    refuses(() => readCbor(Buffer.from('c11a514b67b0', 'hex')))
    refuses(() => readCbor(Buffer.from('d82076687474703a2f2f7777772e6578616d706c652e636f6d', 'hex')))
    refuses(() => readCbor(Buffer.from('d818456449455446', 'hex')))
  })

  it('refuses floats', () => {
    refuses(() => readCbor(Buffer.from('f90000', 'hex')))
    refuses(() => readCbor(Buffer.from('f93c00', 'hex')))
    refuses(() => readCbor(Buffer.from('fa47c35000', 'hex')))
    refuses(() => readCbor(Buffer.from('fb3ff199999999999a', 'hex')))
    refuses(() => readCbor(Buffer.from('f97c00', 'hex'))) // Infinity
  })

  it('refuses lengths and arguments past the end', () => {
    refuses(() => readCbor(Buffer.alloc(0)))
    refuses(() => readCbor(Buffer.from('00', 'hex'), 1))
    refuses(() => readCbor(Buffer.from('1a0001', 'hex')))
    refuses(() => readCbor(Buffer.from('450102', 'hex')))
    refuses(() => readCbor(Buffer.from('6261', 'hex')))
    refuses(() => readCbor(Buffer.from('830102', 'hex')))
    refuses(() => readCbor(Buffer.from('a20102', 'hex')))
    refuses(() => readCbor(Buffer.from('5bffffffffffffffff', 'hex')))
    refuses(() => readCbor(Buffer.from('9bffffffffffffffff00', 'hex')))
    refuses(() => readCbor(Buffer.from('9affffffff00', 'hex')))
  })

  it('refuses nesting deeper than 16, in arrays and maps, however deep', () => {
    refuses(() => readCbor(Buffer.from(`${'81'.repeat(17)}00`, 'hex')))
    refuses(() => readCbor(Buffer.from(`${'a101'.repeat(17)}00`, 'hex')))
    refuses(() => readCbor(Buffer.from(`${'81'.repeat(100_000)}00`, 'hex')))
  })

  it('refuses duplicate map keys', () => {
    refuses(() => readCbor(Buffer.from('a201020103', 'hex')))
    refuses(() => readCbor(Buffer.from('a2616101616102', 'hex')))
  })

  it('refuses 64-bit integers beyond 2^53 - 1', () => {
    refuses(() => readCbor(Buffer.from('1b0020000000000000', 'hex'))) // 2^53
    refuses(() => readCbor(Buffer.from('1b0020000000000001', 'hex')))
    refuses(() => readCbor(Buffer.from('1bffffffffffffffff', 'hex')))
    refuses(() => readCbor(Buffer.from('3b0020000000000000', 'hex'))) // -(2^53) - 1
    refuses(() => readCbor(Buffer.from('3bffffffffffffffff', 'hex')))
  })

  it('refuses reserved additional information and a lone break', () => {
    refuses(() => readCbor(Buffer.from('1c', 'hex')))
    refuses(() => readCbor(Buffer.from('5d', 'hex')))
    refuses(() => readCbor(Buffer.from('ff', 'hex')))
  })
})

// --- 3. readCoseKey -------------------------------------------------------------------------

describe('readCoseKey', () => {
  const credentials = {
    ES256: createCredential(ES256),
    EdDSA: createCredential(EDDSA),
    RS256: createCredential(RS256),
  }

  /** The credential's COSE key with `changes` applied; an undefined value removes the label. */
  function cose(credential: Credential, changes: [number, CborValue][] = []): Map<number, CborValue> {
    const key = coseKey(credential)
    for (const [label, value] of changes) {
      if (value === undefined) key.delete(label)
      else key.set(label, value)
    }
    return key
  }

  for (const [name, credential] of Object.entries(credentials)) {
    it(`reads a ${name} key, as it comes out of readCbor`, () => {
      const { key, algorithm } = readCoseKey(readCbor(encodeCbor(coseKey(credential))).value)
      assert.equal(algorithm, credential.algorithm)
      assert.equal(spki(key), spki(credential.publicKey))
    })
  }

  it('refuses a curve other than P-256 for EC2 and Ed25519 for OKP', () => {
    refuses(() => readCoseKey(cose(credentials.ES256, [[-1, 2]]))) // P-384
    refuses(() => readCoseKey(cose(credentials.ES256, [[-1, 3]]))) // P-521
    refuses(() => readCoseKey(cose(credentials.EdDSA, [[-1, 7]]))) // Ed448
    refuses(() => readCoseKey(cose(credentials.EdDSA, [[-1, 4]]))) // X25519
  })

  it('refuses an unknown key type or algorithm, or one that does not fit the key type', () => {
    refuses(() => readCoseKey(cose(credentials.ES256, [[1, 4]]))) // Symmetric
    refuses(() => readCoseKey(cose(credentials.ES256, [[1, 1]]))) // OKP with EC2 parameters
    refuses(() => readCoseKey(cose(credentials.ES256, [[3, -35]]))) // ES384
    refuses(() => readCoseKey(cose(credentials.ES256, [[3, -8]])))
    refuses(() => readCoseKey(cose(credentials.EdDSA, [[3, -7]])))
    refuses(() => readCoseKey(cose(credentials.RS256, [[3, -37]]))) // PS256
    refuses(() => readCoseKey(cose(credentials.ES256, [[3, undefined]])))
    refuses(() => readCoseKey(cose(credentials.ES256, [[1, undefined]])))
  })

  it('refuses an RSA key shorter than 2048 bits', () => {
    const { publicKey } = generateKeyPairSync('rsa', { modulusLength: 1024 })
    const short = { ...credentials.RS256, publicKey }
    refuses(() => readCoseKey(coseKey(short)))
  })

  it('refuses a key without x, y, n or e, or with a coordinate of the wrong length', () => {
    refuses(() => readCoseKey(cose(credentials.ES256, [[-2, undefined]])))
    refuses(() => readCoseKey(cose(credentials.ES256, [[-3, undefined]])))
    refuses(() => readCoseKey(cose(credentials.EdDSA, [[-2, undefined]])))
    refuses(() => readCoseKey(cose(credentials.RS256, [[-1, undefined]])))
    refuses(() => readCoseKey(cose(credentials.RS256, [[-2, undefined]])))
    refuses(() => readCoseKey(cose(credentials.ES256, [[-2, Buffer.alloc(31, 1)]])))
    refuses(() => readCoseKey(cose(credentials.EdDSA, [[-2, Buffer.alloc(31, 1)]])))
    refuses(() => readCoseKey(cose(credentials.ES256, [[-2, 'not bytes']])))
  })

  it('refuses an EC2 point that is not on the curve', () => {
    refuses(() => readCoseKey(cose(credentials.ES256, [[-3, Buffer.alloc(32, 1)]])))
  })

  it('refuses what is not a map', () => {
    for (const value of [undefined, null, 2, 'key', Buffer.alloc(32), [1, 2]]) refuses(() => readCoseKey(value))
  })
})

// --- 4. verifyRegistration and verifyAuthentication, with a software authenticator --------------

const SITE = { origin: 'https://auth.example', rpId: 'auth.example' }

function newChallenge(): string {
  return base64url(randomBytes(32))
}

for (const [name, algorithm] of [
  ['ES256', ES256],
  ['EdDSA', EDDSA],
  ['RS256', RS256],
] as const) {
  describe(`verifyRegistration with ${name}`, () => {
    const credential = createCredential(algorithm)
    const challenge = newChallenge()
    const expected = { challenge, ...SITE }
    const registration = (changes: Partial<Parameters<typeof register>[1]> = {}, from = credential) =>
      register(from, { challenge, ...SITE, ...changes })

    it('returns the credential: its ID, SPKI public key, algorithm and counter', () => {
      const result = verifyRegistration(registration({ counter: 7 }), expected)
      assert.equal(result.id, base64url(credential.id))
      assert.equal(result.publicKey, spki(credential.publicKey))
      assert.equal(result.algorithm, algorithm)
      assert.equal(result.counter, 7)
    })

    it('accepts a backed-up passkey (BE and BS), and a credential ID of 1023 bytes', () => {
      const flags = FLAGS.UP | FLAGS.UV | FLAGS.AT | FLAGS.BE | FLAGS.BS
      assert.equal(verifyRegistration(registration({ flags }), expected).id, base64url(credential.id))
      const long = { ...credential, id: randomBytes(1023) }
      assert.equal(verifyRegistration(registration({}, long), expected).id, base64url(long.id))
    })

    it('passes over a byte order mark at the start of clientDataJSON, as UTF-8 decode does', () => {
      assert.equal(verifyRegistration(registration({ bom: true }), expected).id, base64url(credential.id))
    })

    it('refuses clientDataJSON of another type', () => {
      refuses(() => verifyRegistration(registration({ type: 'webauthn.get' }), expected))
    })

    it('refuses another challenge', () => {
      refuses(() => verifyRegistration(registration({ challenge: newChallenge() }), expected))
    })

    it('refuses another origin', () => {
      refuses(() => verifyRegistration(registration({ origin: 'https://evil.example' }), expected))
      refuses(() => verifyRegistration(registration({ origin: 'http://auth.example' }), expected))
      refuses(() => verifyRegistration(registration({ origin: 'https://auth.example:8443' }), expected))
    })

    it('refuses crossOrigin true', () => {
      refuses(() => verifyRegistration(registration({ crossOrigin: true }), expected), CROSS_ORIGIN)
    })

    it('refuses authenticator data for another RP ID', () => {
      refuses(() => verifyRegistration(registration({ rpId: 'evil.example' }), expected))
      refuses(() => verifyRegistration(registration({ rpId: 'sub.auth.example' }), expected))
    })

    it('refuses without UP', () => {
      refuses(() => verifyRegistration(registration({ flags: FLAGS.UV | FLAGS.AT }), expected))
    })

    it('refuses without UV', () => {
      refuses(() => verifyRegistration(registration({ flags: FLAGS.UP | FLAGS.AT }), expected), NO_UV)
    })

    it('refuses BS without BE', () => {
      refuses(() => verifyRegistration(registration({ flags: FLAGS.UP | FLAGS.UV | FLAGS.AT | FLAGS.BS }), expected))
    })

    it('refuses authenticator data without attested credential data', () => {
      refuses(() => verifyRegistration(registration({ flags: FLAGS.UP | FLAGS.UV }), expected))
    })

    it('refuses a credential ID longer than 1023 bytes', () => {
      refuses(() => verifyRegistration(registration({}, { ...credential, id: randomBytes(1024) }), expected))
    })

    it('refuses an algorithm other than -7, -8 and -257', () => {
      refuses(() => verifyRegistration(registration({ algorithm: -35 }), expected))
      refuses(() => verifyRegistration(registration({ algorithm: -65535 }), expected)) // RS1
    })

    it('refuses clientDataJSON that is not JSON, and an attestationObject that is not CBOR', () => {
      const response = registration()
      refuses(() => verifyRegistration({ ...response, clientDataJSON: Buffer.from('{"type":') }, expected))
      const truncated = response.attestationObject.subarray(0, response.attestationObject.length - 1)
      refuses(() => verifyRegistration({ ...response, attestationObject: truncated }, expected))
      refuses(() => verifyRegistration({ ...response, attestationObject: encodeCbor([1, 2]) }, expected))
      const trailing = Buffer.concat([response.attestationObject, Buffer.from([0])])
      refuses(() => verifyRegistration({ ...response, attestationObject: trailing }, expected), /one CBOR map/)
    })

    it('refuses a signature counter at its end, which no sign-in could pass', () => {
      const counted = (counter: number) => register(createCredential(algorithm), { challenge, ...SITE, counter })
      assert.equal(verifyRegistration(counted(0xffff_fffe), expected).counter, 0xffff_fffe)
      refuses(() => verifyRegistration(counted(0xffff_ffff), expected), /counter is at its end/)
    })
  })

  describe(`verifyAuthentication with ${name}`, () => {
    const credential = createCredential(algorithm)
    const challenge = newChallenge()
    const stored = verifyRegistration(register(credential, { challenge, ...SITE }), { challenge, ...SITE })
    const expected = { challenge, ...SITE, publicKey: stored.publicKey, algorithm: stored.algorithm, counter: 0 }
    const assertion = (changes: Partial<Parameters<typeof authenticate>[1]> = {}, from = credential) =>
      authenticate(from, { challenge, ...SITE, ...changes })

    it('returns the new counter', () => {
      assert.deepEqual(verifyAuthentication(assertion({ counter: 1 }), expected), { counter: 1 })
      assert.deepEqual(verifyAuthentication(assertion({ counter: 6 }), { ...expected, counter: 5 }), { counter: 6 })
    })

    it('refuses, rather than throwing something else, when the stored public key is not a key', () => {
      refuses(() => verifyAuthentication(assertion(), { ...expected, publicKey: 'bm90IGEga2V5' }), /stored public key/)
    })

    it('accepts a counter that stays 0 when it was 0: authenticators that keep no counter send 0', () => {
      assert.deepEqual(verifyAuthentication(assertion({ counter: 0 }), expected), { counter: 0 })
    })

    it('refuses a counter equal to or lower than the stored one, as a possible clone', () => {
      refuses(() => verifyAuthentication(assertion({ counter: 5 }), { ...expected, counter: 5 }), /clone/)
      refuses(() => verifyAuthentication(assertion({ counter: 4 }), { ...expected, counter: 5 }), /clone/)
      refuses(() => verifyAuthentication(assertion({ counter: 0 }), { ...expected, counter: 5 }), /clone/)
    })

    it('refuses a counter at its end: stored, it could never grow again, yet would count as a passkey left', () => {
      // a device of its own: the software authenticator counts on from the counter it last sent
      const device = createCredential(algorithm)
      const made = verifyRegistration(register(device, { challenge, ...SITE }), { challenge, ...SITE })
      const held = { ...expected, publicKey: made.publicKey, algorithm: made.algorithm, counter: 5 }
      refuses(() => verifyAuthentication(assertion({ counter: 0xffff_ffff }, device), held), /at its end/)
      assert.deepEqual(verifyAuthentication(assertion({ counter: 0xffff_fffe }, device), held), {
        counter: 0xffff_fffe,
      })
    })

    it('refuses clientDataJSON of another type', () => {
      refuses(() => verifyAuthentication(assertion({ type: 'webauthn.create' }), expected))
    })

    it('refuses another challenge', () => {
      refuses(() => verifyAuthentication(assertion({ challenge: newChallenge() }), expected))
    })

    it('refuses another origin', () => {
      refuses(() => verifyAuthentication(assertion({ origin: 'https://evil.example' }), expected))
    })

    it('refuses crossOrigin true', () => {
      refuses(() => verifyAuthentication(assertion({ crossOrigin: true }), expected), CROSS_ORIGIN)
    })

    it('refuses authenticator data for another RP ID', () => {
      refuses(() => verifyAuthentication(assertion({ rpId: 'evil.example' }), expected))
    })

    it('refuses without UP', () => {
      refuses(() => verifyAuthentication(assertion({ flags: FLAGS.UV }), expected))
    })

    it('refuses without UV', () => {
      refuses(() => verifyAuthentication(assertion({ flags: FLAGS.UP }), expected), NO_UV)
    })

    it('refuses a signature with one byte changed', () => {
      for (const at of [0, 10, -1]) {
        const response = assertion()
        const signature = Buffer.from(response.signature)
        signature[at < 0 ? signature.length + at : at] ^= 0x01
        refuses(() => verifyAuthentication({ ...response, signature }, expected))
      }
    })

    it('refuses a signature over other data, or by another key', () => {
      const response = assertion()
      // clientDataJSON itself rather than its hash
      const unhashed = signWith(credential, Buffer.concat([response.authenticatorData, response.clientDataJSON]))
      refuses(() => verifyAuthentication({ ...response, signature: unhashed }, expected))
      const other = signWith(credential, Buffer.concat([response.authenticatorData, sha256(Buffer.from('{}'))]))
      refuses(() => verifyAuthentication({ ...response, signature: other }, expected))
      refuses(() => verifyAuthentication(assertion({}, createCredential(algorithm)), expected))
      refuses(() => verifyAuthentication({ ...response, signature: Buffer.alloc(0) }, expected))
    })

    it('refuses clientDataJSON changed after signing', () => {
      const response = assertion({ origin: 'https://evil.example' })
      const clientDataJSON = Buffer.from(
        response.clientDataJSON.toString().replace('https://evil.example', SITE.origin),
      )
      refuses(() => verifyAuthentication({ ...response, clientDataJSON }, expected))
    })

    it('refuses a stored algorithm it does not know', () => {
      refuses(() => verifyAuthentication(assertion(), { ...expected, algorithm: -35 }))
    })

    it('refuses a sign-in whose authenticator data carries a new credential, signed as it is', () => {
      const response = assertion()
      const flags = FLAGS.UP | FLAGS.UV | FLAGS.AT
      const attested = {
        aaguid: Buffer.alloc(16),
        id: randomBytes(16),
        publicKey: coseKey(createCredential(algorithm)),
      }
      const authenticatorData = authenticatorDataOf({ rpId: SITE.rpId, flags, counter: 9, attested })
      const signature = signWith(credential, Buffer.concat([authenticatorData, sha256(response.clientDataJSON)]))
      refuses(() => verifyAuthentication({ ...response, authenticatorData, signature }, expected), /new credential/)
    })

    it('refuses authenticator data shorter than 37 bytes', () => {
      const response = assertion()
      const authenticatorData = response.authenticatorData.subarray(0, 36)
      const signature = signWith(credential, Buffer.concat([authenticatorData, sha256(response.clientDataJSON)]))
      refuses(() => verifyAuthentication({ ...response, authenticatorData, signature }, expected))
    })

    if (algorithm === ES256) {
      it('refuses an ES256 signature that is not DER (raw r || s)', () => {
        const response = assertion()
        const signed = Buffer.concat([response.authenticatorData, sha256(response.clientDataJSON)])
        const raw = sign('sha256', signed, { key: credential.privateKey, dsaEncoding: 'ieee-p1363' })
        refuses(() => verifyAuthentication({ ...response, signature: raw }, expected))
      })
    }
  })
}

// --- 5. Over HTTP ---------------------------------------------------------------------------

const PASSWORD = 'correct horse'
const ME = 'https://example.com/'

/** Latch with a password, on an issuer with a host name (WebAuthn takes no IP address as an RP ID): http://localhost:PORT. */
type Latch = TestServer

async function startLatch(): Promise<Latch> {
  const passwordHash = await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 })
  return startTestLatch({ HOST: 'localhost', ME, PASSWORD_HASH: passwordHash, DATA_FILE: 'memory' })
}

/** A browser: it keeps the cookies Latch sets, and sends them back. */
type Browser = {
  cookies: Map<string, string>
  get: (path: string) => Promise<Response>
  /** `headers`, such as the `Sec-Fetch-Site` a real browser adds. */
  post: (path: string, fields: Record<string, string>, headers?: Record<string, string>) => Promise<Response>
}

/** A browser; `forwardedFor`, the address a proxy of TRUST_PROXY says it comes from. */
function openBrowser(latch: Latch, forwardedFor?: string): Browser {
  const cookies = new Map<string, string>()
  const send = async (path: string, init: RequestInit) => {
    const cookie = [...cookies].map(([name, value]) => `${name}=${value}`).join('; ')
    const headers: Record<string, string> = { ...(init.headers as Record<string, string>) }
    if (cookie !== '') headers.Cookie = cookie
    if (forwardedFor !== undefined) headers['X-Forwarded-For'] = forwardedFor
    const response = await fetch(`${latch.issuer}${path}`, {
      // under its name, as a browser must for passkeys
      ...init,
      redirect: 'manual',
      headers,
    })
    for (const line of response.headers.getSetCookie()) {
      const [pair, ...attributes] = line.split(';')
      const [name, value] = [pair.slice(0, pair.indexOf('=')), pair.slice(pair.indexOf('=') + 1)]
      if (attributes.some((attribute) => /^\s*Max-Age=0$/i.test(attribute)) || value === '') cookies.delete(name)
      else cookies.set(name, value)
    }
    return response
  }
  return {
    cookies,
    get: (path) => send(path, {}),
    post: (path, fields, headers = {}) =>
      send(path, {
        method: 'POST',
        headers: { 'Content-Type': 'application/x-www-form-urlencoded', ...headers },
        body: new URLSearchParams(fields).toString(),
      }),
  }
}

/** The hidden csrf field of the page at /apps: the sign-in page, or the apps page when signed in. */
async function formToken(browser: Browser): Promise<string> {
  const response = await browser.get('/apps')
  assert.equal(response.status, 200)
  const token = /name="csrf" value="([^"]+)"/.exec(await response.text())?.[1]
  assert.ok(token)
  return token
}

async function signInWithPassword(browser: Browser): Promise<void> {
  const response = await browser.post('/sign-in', { csrf: await formToken(browser), password: PASSWORD })
  assert.equal(response.status, 303)
  assert.ok(browser.cookies.has('latch_session'))
}

/** Latch on a store of the test's own, and a browser signed in there with the password. */
async function signedInOnStore(store: Store): Promise<{ latch: Latch; browser: Browser }> {
  const passwordHash = await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 })
  const latch = await startTestLatch({ HOST: 'localhost', ME, PASSWORD_HASH: passwordHash }, { store })
  const browser = openBrowser(latch)
  await signInWithPassword(browser)
  return { latch, browser }
}

async function signOut(browser: Browser): Promise<void> {
  const response = await browser.post('/sign-out', { csrf: await formToken(browser) })
  assert.equal(response.status, 303)
  assert.equal(browser.cookies.has('latch_session'), false)
}

type CreationOptions = {
  challenge: string
  rp: { id: string; name: string }
  user: { id: string; name: string; displayName: string }
  pubKeyCredParams: { type: string; alg: number }[]
  attestation: string
  authenticatorSelection: { residentKey: string; requireResidentKey: boolean; userVerification: string }
  excludeCredentials: { type: string; id: string }[]
}
type RequestOptions = { challenge: string; rpId: string; userVerification: string; allowCredentials: unknown[] }

/** POST /passkeys/challenge, as the passkey script does, with the page's csrf field. */
async function askChallenge(browser: Browser, purpose: 'register'): Promise<CreationOptions>
async function askChallenge(browser: Browser, purpose: 'sign-in'): Promise<RequestOptions>
async function askChallenge(browser: Browser, purpose: string): Promise<unknown> {
  const response = await browser.post('/passkeys/challenge', { csrf: await formToken(browser), purpose })
  const text = await response.text()
  assert.equal(response.status, 200, text)
  assert.match(response.headers.get('content-type') ?? '', /^application\/json/)
  return JSON.parse(text)
}

/** The fields of POST /passkeys/add, as the script sends them after navigator.credentials.create(). */
async function additionFields(latch: Latch, browser: Browser, credential: Credential, name: string) {
  const options = await askChallenge(browser, 'register')
  const response = register(credential, {
    challenge: options.challenge,
    origin: latch.issuer,
    rpId: options.rp.id,
    userHandle: Buffer.from(options.user.id, 'base64url'),
  })
  return {
    csrf: await formToken(browser),
    name,
    credential: response.id,
    client_data: base64url(response.clientDataJSON),
    attestation: base64url(response.attestationObject),
  }
}

/** Registers `credential` from a signed-in browser. */
async function addPasskey(latch: Latch, browser: Browser, credential: Credential, name: string): Promise<Response> {
  return browser.post('/passkeys/add', await additionFields(latch, browser, credential, name))
}

/** The fields of POST /sign-in for a passkey: a fresh challenge, answered by `credential` with `changes`. */
async function passkeyFields(
  latch: Latch,
  browser: Browser,
  credential: Credential,
  changes: Partial<Parameters<typeof authenticate>[1]> = {},
): Promise<Record<string, string>> {
  const options = await askChallenge(browser, 'sign-in')
  const response = authenticate(credential, {
    challenge: options.challenge,
    origin: latch.issuer,
    rpId: options.rpId,
    ...changes,
  })
  return {
    csrf: await formToken(browser),
    credential: response.id,
    client_data: base64url(response.clientDataJSON),
    authenticator_data: base64url(response.authenticatorData),
    signature: base64url(response.signature),
    user_handle: base64url(response.userHandle),
  }
}

async function signInWithPasskey(
  latch: Latch,
  browser: Browser,
  credential: Credential,
  changes: Partial<Parameters<typeof authenticate>[1]> = {},
): Promise<Response> {
  return browser.post('/sign-in', await passkeyFields(latch, browser, credential, changes))
}

/**
 * A synced passkey of the owner's (it keeps no counter, and sends 0), added, and its answer to a
 * sign-in challenge in another browser, not yet sent.
 */
async function syncedPasskeyAnswer(latch: Latch): Promise<{ browser: Browser; fields: Record<string, string> }> {
  const synced = createCredential(ES256)
  const owner = openBrowser(latch)
  await signInWithPassword(owner)
  assert.equal((await addPasskey(latch, owner, synced, 'Synced')).status, 200)
  const browser = openBrowser(latch)
  await formToken(browser)
  return { browser, fields: await passkeyFields(latch, browser, synced, { counter: 0 }) }
}

function contentSecurityPolicy(response: Response): string {
  return response.headers.get('content-security-policy') ?? ''
}

describe('Passkeys over HTTP', () => {
  let latch: Latch
  const owner = createCredential(ES256)
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  /** A day later: the failed attempts of earlier tests no longer count against the next. */
  const quietDay = () => latch.advance(86401)

  it('shows no passkey button and allows no script while no passkey is stored', async () => {
    const browser = openBrowser(latch)
    const signInPage = await browser.get('/apps')
    assert.equal(signInPage.status, 200)
    assert.doesNotMatch(await signInPage.text(), /Sign in with a passkey/)
    assert.doesNotMatch(contentSecurityPolicy(signInPage), /script-src/)
    const home = await browser.get('/')
    assert.equal(home.status, 200)
    assert.match(contentSecurityPolicy(home), /default-src 'none'/)
    assert.doesNotMatch(contentSecurityPolicy(home), /script-src/)
  })

  it('gives two Latches under one host name, and one ME, user handles and account names of their own', async () => {
    // a device keeps one passkey per host name and user handle: with one handle for both, adding a
    // passkey at one Latch would make the device forget the other's; and where it offers both, it
    // shows their names beside the host name, not the port
    const other = await startLatch()
    try {
      const users: { id: string; name: string }[] = []
      for (const server of [latch, other]) {
        const browser = openBrowser(server)
        await signInWithPassword(browser)
        const options = await askChallenge(browser, 'register')
        assert.equal(options.rp.id, 'localhost')
        assert.equal(options.user.name, `:${new URL(server.issuer).port} · ${ME}`)
        users.push(options.user)
      }
      assert.notEqual(users[0].id, users[1].id)
      assert.notEqual(users[0].name, users[1].name)
    } finally {
      await other.close()
    }
  })

  it('gives a register challenge to the signed-in owner only', async () => {
    const browser = openBrowser(latch)
    const refused = await browser.post('/passkeys/challenge', { csrf: await formToken(browser), purpose: 'register' })
    assert.equal(refused.status, 403)
    await signInWithPassword(browser)
    const options = await askChallenge(browser, 'register')
    assert.equal(Buffer.from(options.challenge, 'base64url').length >= 16, true)
    assert.equal(options.rp.id, 'localhost')
    const userId = createHash('sha256').update(`latch user ${ME} at ${latch.issuer}`).digest().subarray(0, 16)
    assert.equal(options.user.id, base64url(userId))
    assert.ok(options.pubKeyCredParams.every((parameters) => parameters.type === 'public-key'))
    assert.deepEqual(options.pubKeyCredParams.map((parameters) => parameters.alg).sort(), [EDDSA, ES256, RS256].sort())
    assert.equal(options.attestation, 'none')
    assert.deepEqual(options.authenticatorSelection, {
      residentKey: 'required',
      requireResidentKey: true,
      userVerification: 'required',
    })
    assert.deepEqual(options.excludeCredentials, [])
  })

  it('adds a passkey after a password sign-in, lists it, and excludes it from the next registration', async () => {
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    const added = await addPasskey(latch, browser, owner, 'Laptop')
    const page = await added.text()
    assert.equal(added.status, 200, page)
    assert.match(page, /Added the passkey (?:<bdi>)?Laptop(?:<\/bdi>)?\./)
    const apps = await (await browser.get('/apps')).text()
    assert.match(apps, /Passkeys/)
    assert.match(apps, /Laptop/)
    const next = await askChallenge(browser, 'register')
    assert.deepEqual(next.excludeCredentials, [{ type: 'public-key', id: base64url(owner.id) }])
  })

  it('answers the page that added a passkey, sent again by a reload, with 200 and no refusal logged', async () => {
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    const fields = await additionFields(latch, browser, createCredential(ES256), 'Tablet')
    assert.equal((await browser.post('/passkeys/add', fields)).status, 200)
    const logged = latch.logs.length
    const again = await browser.post('/passkeys/add', fields) // its challenge is used now
    assert.equal(again.status, 200)
    assert.match(await again.text(), /That passkey was added before\./)
    assert.deepEqual(
      latch.logs.slice(logged).filter((line) => / security: /.test(line)),
      [],
    )
  })

  it('adds a twentieth passkey, and refuses a twenty-first until one is removed', async () => {
    const store = new MemoryStore()
    const { latch: own, browser } = await signedInOnStore(store)
    try {
      for (let i = 1; i < 20; i++)
        assert.equal((await addPasskey(own, browser, createCredential(), `Key ${i}`)).status, 200)
      assert.equal((await addPasskey(own, browser, createCredential(), 'Key 20')).status, 200)
      const refused = await addPasskey(own, browser, createCredential(), 'Key 21')
      assert.equal(refused.status, 400)
      assert.match(await refused.text(), /there are 20 passkeys already: remove one first/)
      assert.equal((await store.listPasskeys()).length, 20)
    } finally {
      await own.close()
    }
  })

  it('refuses a new key under the id of a passkey already added, and keeps the stored key', async () => {
    const store = new MemoryStore()
    const { latch: own, browser } = await signedInOnStore(store)
    try {
      const first = createCredential(ES256)
      assert.equal((await addPasskey(own, browser, first, 'Watch')).status, 200)
      const stored = (await store.findPasskey(base64url(first.id)))?.publicKey
      const same = createCredential(ES256, first.id)
      const { credential: _sent, ...fields } = await additionFields(own, browser, same, 'Fake') // the script sends none
      const refused = await browser.post('/passkeys/add', fields)
      assert.equal(refused.status, 400)
      assert.match(await refused.text(), /The passkey was not added: this passkey was added before/)
      assert.equal((await store.findPasskey(base64url(first.id)))?.publicKey, stored)
    } finally {
      await own.close()
    }
  })

  it('refuses to add a passkey whose answer fails a check, with 400', async () => {
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    const options = await askChallenge(browser, 'register')
    const stranger = createCredential(ES256)
    const response = register(stranger, {
      challenge: options.challenge,
      origin: 'https://evil.example',
      rpId: 'localhost',
    })
    const refused = await browser.post('/passkeys/add', {
      csrf: await formToken(browser),
      name: 'Stranger',
      credential: response.id,
      client_data: base64url(response.clientDataJSON),
      attestation: base64url(response.attestationObject),
    })
    assert.equal(refused.status, 400)
    assert.doesNotMatch(await (await browser.get('/apps')).text(), /Stranger/)
  })

  it('answers a name sent without a passkey, as a form sent without its script is, with 400 and how to add one', async () => {
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    const logged = latch.logs.length
    const refused = await browser.post('/passkeys/add', { csrf: await formToken(browser), name: 'Tablet' })
    assert.equal(refused.status, 400)
    assert.match(await refused.text(), /No passkey was added: press Add a passkey, in a browser that makes passkeys\./)
    assert.deepEqual(
      latch.logs.slice(logged).filter((line) => line.includes('security:')),
      [],
    )
  })

  it('signs in with the passkey after signing out: 303 to /apps with a session cookie', async () => {
    quietDay()
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    await signOut(browser)
    const signInPage = await browser.get('/apps')
    assert.match(await signInPage.text(), /Sign in with a passkey/)
    const options = await askChallenge(browser, 'sign-in')
    assert.equal(options.rpId, 'localhost')
    assert.equal(options.userVerification, 'required')
    assert.deepEqual(options.allowCredentials, [])
    const response = await signInWithPasskey(latch, browser, owner)
    assert.equal(response.status, 303, await response.text())
    assert.equal(response.headers.get('location'), `${latch.issuer}/apps`)
    assert.match(response.headers.get('set-cookie') ?? '', /^latch_session=[A-Za-z0-9_-]{43};/)
    const apps = await (await browser.get('/apps')).text()
    assert.doesNotMatch(apps, /type="password"/)
    assert.match(apps, /Laptop/)
  })

  it('signs in with the passkey from a sign-in page left open while another tab signed in', async () => {
    quietDay()
    const browser = openBrowser(latch)
    const stale = await formToken(browser) // the sign-in page of one tab
    await signInWithPassword(browser) // another tab signs in
    const sameOrigin = { 'Sec-Fetch-Site': 'same-origin' } // as a browser says of this server's own page
    const asked = await browser.post('/passkeys/challenge', { csrf: stale, purpose: 'sign-in' }, sameOrigin)
    assert.equal(asked.status, 200, await asked.clone().text())
    const options = (await asked.json()) as RequestOptions
    const answer = authenticate(owner, { challenge: options.challenge, origin: latch.issuer, rpId: options.rpId })
    const response = await browser.post(
      '/sign-in',
      {
        csrf: stale,
        credential: answer.id,
        client_data: base64url(answer.clientDataJSON),
        authenticator_data: base64url(answer.authenticatorData),
        signature: base64url(answer.signature),
        user_handle: base64url(answer.userHandle),
      },
      sameOrigin,
    )
    assert.equal(response.status, 303, await response.text())
    assert.doesNotMatch(await (await browser.get('/apps')).text(), /type="password"/)
  })

  it('asks for a sign-in of the last 15 minutes before adding a passkey, and a sign-in on /apps renews it', async () => {
    quietDay()
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    const askRegister = async () =>
      browser.post('/passkeys/challenge', { csrf: await formToken(browser), purpose: 'register' })
    latch.advance(-60) // the clock set back: a sign-in that has not happened yet is not a recent one
    assert.equal((await askRegister()).status, 403)
    latch.advance(60 + 899)
    const options = await askChallenge(browser, 'register')
    latch.advance(101) // 1,000 seconds after the sign-in
    const page = await (await browser.get('/apps')).text()
    assert.doesNotMatch(page, /action="[^"]*\/passkeys\/add"/)
    assert.match(page, /To add a passkey, sign in again first/)
    assert.match(page, /<form method="post" action="[^"]*\/sign-in">[^]*data-passkey="sign-in"/)
    const refused = await askRegister()
    assert.equal(refused.status, 403)
    assert.equal(((await refused.json()) as { error: string }).error, 'access_denied')
    // a ceremony begun within the 15 minutes ends with its challenge, not in the middle
    const phone = createCredential(ES256)
    const made = register(phone, {
      challenge: options.challenge,
      origin: latch.issuer,
      rpId: options.rp.id,
      userHandle: Buffer.from(options.user.id, 'base64url'),
    })
    const fields = async (name: string) => ({
      csrf: await formToken(browser),
      name,
      credential: made.id,
      client_data: base64url(made.clientDataJSON),
      attestation: base64url(made.attestationObject),
    })
    const inTime = await browser.post('/passkeys/add', await fields('Phone'))
    assert.equal(inTime.status, 200, await inTime.text())
    latch.advance(200) // 20 minutes: past any challenge made in time
    const late = await browser.post('/passkeys/add', await fields('Late'))
    assert.equal(late.status, 403)
    assert.match(await late.text(), /To add a passkey, sign in again first/)
    assert.doesNotMatch(await (await browser.get('/apps')).text(), /Late/)
    assert.ok(
      latch.logs.some((line) => / security: a passkey was not added: the session signed in 20 minutes ago$/.test(line)),
    )

    const wrong = await browser.post('/sign-in', { csrf: await formToken(browser), password: 'wrong' })
    assert.equal(wrong.status, 401)
    const wrongPage = await wrong.text()
    assert.match(wrongPage, /<h1>Connected apps<\/h1>/) // still signed in, and still on /apps
    assert.match(wrongPage, /role="alert">Wrong password<\/p>/)
    // signing in again ends every session the browser names: its own, and one planted or left over
    const other = openBrowser(latch)
    await signInWithPassword(other)
    const sessions = [browser.cookies.get('latch_session'), other.cookies.get('latch_session')]
    const again = await fetch(`${latch.issuer}/sign-in`, {
      method: 'POST',
      headers: {
        'Content-Type': 'application/x-www-form-urlencoded',
        Cookie: `latch_csrf=${browser.cookies.get('latch_csrf')}; ${sessions.map((s) => `latch_session=${s}`).join('; ')}`,
      },
      body: new URLSearchParams({ csrf: await formToken(browser), password: PASSWORD }).toString(),
      redirect: 'manual',
    })
    assert.equal(again.status, 303)
    const renewed = /^latch_session=([A-Za-z0-9_-]{43});/.exec(again.headers.get('set-cookie') ?? '')?.[1] ?? ''
    assert.ok(renewed)
    for (const session of sessions) {
      const old = await fetch(`${latch.issuer}/apps`, { headers: { Cookie: `latch_session=${session}` } })
      assert.doesNotMatch(await old.text(), /Connected apps/)
    }
    browser.cookies.set('latch_session', renewed)
    const added = await addPasskey(latch, browser, createCredential(ES256), 'Tablet')
    assert.equal(added.status, 200, await added.text())
  })

  it('refuses the same answer posted again: its challenge was used', async () => {
    quietDay()
    const browser = openBrowser(latch)
    await formToken(browser)
    const fields = await passkeyFields(latch, browser, owner)
    assert.equal((await browser.post('/sign-in', fields)).status, 303)
    browser.cookies.delete('latch_session') // signed out again, with the same CSRF cookie
    const replayed = await browser.post('/sign-in', fields)
    assert.equal(replayed.status, 401)
    assert.equal(browser.cookies.has('latch_session'), false)
  })

  it('refuses the same answer posted again from a passkey that keeps no counter, as synced passkeys send 0', async () => {
    quietDay()
    const { browser, fields } = await syncedPasskeyAnswer(latch)
    assert.equal((await browser.post('/sign-in', fields)).status, 303)
    browser.cookies.delete('latch_session') // signed out again, with the same CSRF cookie
    assert.equal((await browser.post('/sign-in', fields)).status, 401) // only the challenge's single use stops it
  })

  for (const [what, changes] of [
    ['made for another origin', { origin: 'https://evil.example' }],
    ['for another RP ID', { rpId: 'example.com' }],
  ] as const) {
    it(`refuses an answer ${what}`, async () => {
      quietDay()
      const browser = openBrowser(latch)
      const response = await signInWithPasskey(latch, browser, owner, changes)
      assert.equal(response.status, 401)
      assert.equal(browser.cookies.has('latch_session'), false)
    })
  }

  it('signs in with client data that begins with a byte order mark', async () => {
    quietDay()
    const browser = openBrowser(latch)
    assert.equal((await signInWithPasskey(latch, browser, owner, { bom: true })).status, 303)
    assert.equal(browser.cookies.has('latch_session'), true)
  })

  it('refuses a lower counter as a possible clone, and logs it', async () => {
    quietDay()
    const browser = openBrowser(latch)
    assert.equal((await signInWithPasskey(latch, browser, owner, { counter: 10 })).status, 303)
    browser.cookies.delete('latch_session')
    const logged = latch.logs.length
    const cloned = await signInWithPasskey(latch, browser, owner, { counter: 9 })
    assert.equal(cloned.status, 401)
    assert.equal(browser.cookies.has('latch_session'), false)
    assert.ok(
      latch.logs.slice(logged).some((line) => /clone/i.test(line)),
      latch.logs.slice(logged).join('\n'),
    )
  })

  it('refuses a challenge made for another browser, which cannot use it up for the browser it was made for', async () => {
    quietDay()
    const browser = openBrowser(latch)
    const other = openBrowser(latch)
    const fields = await passkeyFields(latch, browser, owner, { counter: 100 }) // above any counter before
    const stolen = await other.post('/sign-in', { ...fields, csrf: await formToken(other) })
    assert.equal(stolen.status, 401)
    assert.equal(other.cookies.has('latch_session'), false)
    assert.match(latch.logs.at(-2) ?? '', /not made by this server for this page and browser/)
    assert.equal((await browser.post('/sign-in', fields)).status, 303)
  })

  it('refuses a challenge older than 5 minutes', async () => {
    quietDay()
    const browser = openBrowser(latch)
    const fields = await passkeyFields(latch, browser, owner)
    latch.advance(301)
    assert.equal((await browser.post('/sign-in', fields)).status, 401)
  })

  it('refuses a passkey it does not know', async () => {
    quietDay()
    const browser = openBrowser(latch)
    const response = await signInWithPasskey(latch, browser, createCredential(ES256))
    assert.equal(response.status, 401)
  })

  it('counts failed passkey sign-ins against the throttle it shares with passwords', async () => {
    quietDay()
    const browser = openBrowser(latch)
    // as with passwords: five free attempts, the sixth still answered but locking for 2 seconds
    for (let i = 0; i < 6; i++) {
      const failed = await signInWithPasskey(latch, browser, owner, { origin: 'https://evil.example' })
      assert.equal(failed.status, 401, `attempt ${i + 1}`)
    }
    const throttled = await signInWithPasskey(latch, browser, owner)
    assert.equal(throttled.status, 429)
    assert.equal(throttled.headers.get('retry-after'), '2')
    const password = await browser.post('/sign-in', { csrf: await formToken(browser), password: PASSWORD })
    assert.equal(password.status, 429)
    latch.advance(2)
    assert.equal((await signInWithPasskey(latch, browser, owner)).status, 303)
  })

  it('allows /passkey.js as the only script of a page with a passkey button; / allows none', async () => {
    const browser = openBrowser(latch)
    const signInPage = await browser.get('/apps') // signed out, with a passkey stored
    const html = await signInPage.text()
    assert.match(html, /Sign in with a passkey/)
    assert.ok(html.includes(`<script src="${latch.issuer}/passkey.js" defer></script>`), html)
    const policy = contentSecurityPolicy(signInPage)
    assert.match(policy, /default-src 'none'/)
    assert.ok(policy.includes(`script-src ${latch.issuer}/passkey.js`), policy)
    assert.ok(policy.includes(`connect-src ${latch.issuer}/passkeys/challenge`), policy)
    await signInWithPassword(browser)
    const appsPage = await browser.get('/apps') // signed in: the "Add a passkey" button
    const apps = await appsPage.text()
    assert.match(apps, /Add a passkey/)
    // the button and the passkey's name box are for the script to show: without it, neither works
    assert.match(apps, /<p data-passkey-only hidden><label>Passkey name\s<input name="name"/)
    assert.ok(contentSecurityPolicy(appsPage).includes(`script-src ${latch.issuer}/passkey.js`))
    const home = await browser.get('/')
    assert.doesNotMatch(contentSecurityPolicy(home), /script-src/)
    const script = await browser.get('/passkey.js')
    assert.equal(script.status, 200)
    assert.match(script.headers.get('content-type') ?? '', /javascript/)
  })

  it('removes a passkey, which then no longer signs in', async () => {
    quietDay()
    const browser = openBrowser(latch)
    await signInWithPassword(browser)
    const removed = await browser.post('/passkeys/remove', {
      csrf: await formToken(browser),
      credential: base64url(owner.id),
    })
    assert.equal(removed.status, 200)
    assert.match(await removed.text(), /Removed the passkey (?:<bdi>)?Laptop(?:<\/bdi>)?/)
    assert.ok(!(await (await browser.get('/apps')).text()).includes(base64url(owner.id)))
    await signOut(browser)
    assert.equal((await signInWithPasskey(latch, browser, owner)).status, 401)
  })
})

describe('Passkeys under attack', () => {
  /** Latch behind a proxy on loopback, with the owner's passkey, and the owner's browser at home, signed out. */
  async function behindProxyWithPasskey(): Promise<{ latch: Latch; owner: Credential; home: Browser }> {
    const passwordHash = await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 })
    const settings = { HOST: 'localhost', ME, PASSWORD_HASH: passwordHash, TRUST_PROXY: '127.0.0.1,::1' }
    const latch = await startTestLatch({ ...settings, DATA_FILE: 'memory' })
    const owner = createCredential(ES256)
    const home = openBrowser(latch, '192.0.2.1')
    await signInWithPassword(home)
    assert.equal((await addPasskey(latch, home, owner, 'Phone')).status, 200)
    await signOut(home)
    return { latch, owner, home }
  }

  /** Twenty-one wrong passwords from as many addresses: the total's lock, for everyone's password. */
  async function lockPasswords(latch: Latch, network: string): Promise<void> {
    for (let i = 0; i < 21; i++) {
      const stranger = openBrowser(latch, `${network}.${i}`)
      const wrong = await stranger.post('/sign-in', { password: 'a guess', csrf: await formToken(stranger) })
      assert.equal(wrong.status, 401, `guess ${i}`)
    }
  }

  /** A passkey answer that names no passkey of the server, as a stranger can send. */
  const junk = { credential: 'x', client_data: 'e30', authenticator_data: 'AA', signature: 'AA' }

  it('signs the owner in with a passkey while strangers’ failures from many addresses lock passwords out', async () => {
    const { latch, owner, home } = await behindProxyWithPasskey()
    try {
      // thirty strangers who learnt the passkey's id answer with keys of their own, each under its
      // address's five free attempts: counted there, and not in the total, as a passkey cannot be guessed
      for (let i = 0; i < 30; i++) {
        const stranger = openBrowser(latch, `198.51.100.${i}`)
        const forged = {
          ...(await passkeyFields(latch, stranger, createCredential(ES256))),
          credential: base64url(owner.id),
        }
        assert.equal((await stranger.post('/sign-in', forged)).status, 401, `stranger ${i}`)
      }
      await signInWithPassword(home) // the total is not locked
      await signOut(home)
      assert.equal((await signInWithPasskey(latch, home, owner)).status, 303)
      await signOut(home)
      await lockPasswords(latch, '203.0.113')
      const password = await home.post('/sign-in', { password: PASSWORD, csrf: await formToken(home) })
      assert.equal(password.status, 429)
      assert.equal((await signInWithPasskey(latch, home, owner)).status, 303)
    } finally {
      await latch.close()
    }
  })

  it('keeps passwords locked in total when the owner signs in with a passkey meanwhile', async () => {
    const { latch, owner, home } = await behindProxyWithPasskey()
    try {
      await lockPasswords(latch, '203.0.113')
      assert.equal((await signInWithPasskey(latch, home, owner)).status, 303)
      const guesser = openBrowser(latch, '198.51.100.1')
      const next = await guesser.post('/sign-in', { password: 'a guess', csrf: await formToken(guesser) })
      assert.equal(next.status, 429) // the passkey proved the owner, not that the guessing stopped
    } finally {
      await latch.close()
    }
  })

  it('neither counts nor uses up a challenge for an answer that names no passkey of this server', async () => {
    const { latch, owner, home } = await behindProxyWithPasskey()
    try {
      const fields = await passkeyFields(latch, home, owner)
      // the owner's own address: past five counted attempts, the sixth would lock it for 2 seconds
      for (let i = 0; i < 8; i++) {
        const failed = await home.post('/sign-in', { ...fields, ...junk, client_data: fields.client_data })
        assert.equal(failed.status, 401, `junk ${i}`)
      }
      assert.equal((await home.post('/sign-in', fields)).status, 303) // its challenge, still good
    } finally {
      await latch.close()
    }
  })

  it('counts passkey answers sent in parallel from one address, on a store whose lookups take time', async () => {
    const store = new MemoryStore()
    const findPasskey = store.findPasskey.bind(store)
    // a store across a network: once the gate is set, lookups answer when ten are under way together
    let gate: { waiting: number; open: () => void; opened: Promise<void> } | undefined
    store.findPasskey = async (id) => {
      if (gate !== undefined && ++gate.waiting === 10) gate.open()
      await gate?.opened
      return findPasskey(id)
    }
    const { latch, browser } = await signedInOnStore(store)
    try {
      const owner = createCredential(ES256)
      assert.equal((await addPasskey(latch, browser, owner, 'Phone')).status, 200)
      await signOut(browser)
      // a stranger who learnt the passkey's id, signing with a key of its own
      const forged = []
      for (let i = 0; i < 10; i++)
        forged.push({
          ...(await passkeyFields(latch, browser, createCredential(ES256))),
          credential: base64url(owner.id),
        })
      let open = () => {}
      gate = { waiting: 0, open: () => open(), opened: new Promise((resolve) => (open = resolve)) }
      const statuses = (await Promise.all(forged.map((fields) => browser.post('/sign-in', fields)))).map(
        (r) => r.status,
      )
      assert.deepEqual(statuses.sort(), [401, 401, 401, 401, 401, 401, 429, 429, 429, 429])
    } finally {
      await latch.close()
    }
  })

  it('keeps the owner’s challenge good through a flood of challenges asked by strangers', async () => {
    const latch = await startLatch()
    try {
      const owner = createCredential(ES256)
      const browser = openBrowser(latch)
      await signInWithPassword(browser)
      assert.equal((await addPasskey(latch, browser, owner, 'Phone')).status, 200)
      await signOut(browser)
      const fields = await passkeyFields(latch, browser, owner) // the owner's challenge, not yet answered
      const stranger = openBrowser(latch)
      const csrf = await formToken(stranger)
      for (let round = 0; round < 11; round++) {
        const asked = Array.from({ length: 100 }, () =>
          stranger.post('/passkeys/challenge', { csrf, purpose: 'sign-in' }),
        )
        for (const response of await Promise.all(asked)) assert.equal(response.status, 200)
      }
      const signedIn = await browser.post('/sign-in', fields)
      assert.equal(signedIn.status, 303, await signedIn.text())
    } finally {
      await latch.close()
    }
  })

  it('refuses a credential with an empty id, which could never be named again', async () => {
    const latch = await startLatch()
    try {
      const browser = openBrowser(latch)
      await signInWithPassword(browser)
      const refused = await addPasskey(latch, browser, createCredential(ES256, Buffer.alloc(0)), 'Empty')
      assert.equal(refused.status, 400)
      assert.match(await refused.text(), /The passkey was not added: the credential id is empty/)
      assert.match(await (await browser.get('/apps')).text(), /No passkey yet/)
    } finally {
      await latch.close()
    }
  })

  /**
   * Latch with password sign-in off and two stored passkeys, `changes` made to each, and a
   * browser in which the owner is signed in.
   */
  async function signedInWithPasskeysOnly(store: Store, changes: [Partial<Passkey>, Partial<Passkey>]) {
    const passwordHash = await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 })
    const passkey = { name: 'Phone', publicKey: 'MCowBQYDK2VwAyEA', algorithm: EDDSA, counter: 0, addedAt: 0 }
    await store.savePasskey('credential-1', { ...passkey, lastUsedAt: undefined, ...changes[0] }, 0)
    await store.savePasskey('credential-2', { ...passkey, name: 'Laptop', lastUsedAt: undefined, ...changes[1] }, 0)
    const env = { HOST: 'localhost', ME, PASSWORD_HASH: passwordHash, PASSWORD_SIGN_IN: 'off' }
    const latch = await startTestLatch(env, { store })
    const session = randomBytes(32).toString('base64url')
    const passwordTag = hashSecret(`latch session ${passwordHash}`)
    const now = Date.UTC(2027, 0, 1)
    await store.saveSession(hashSecret(session), { createdAt: now, expiresAt: now + 3_600_000, passwordTag }, now)
    const browser = openBrowser(latch)
    browser.cookies.set('latch_session', session)
    return { latch, browser }
  }

  it('keeps the last passkey for this host while password sign-in is off, and marks one made for another', async () => {
    const store = new MemoryStore()
    const { latch, browser } = await signedInWithPasskeysOnly(store, [{ rpId: 'old.example' }, { rpId: 'localhost' }])
    try {
      const apps = await (await browser.get('/apps')).text()
      assert.ok(apps.includes('<dt>Made for</dt><dd><code><bdi>old.example</bdi></code>: it cannot sign in here</dd>'))
      const csrf = await formToken(browser)
      assert.equal((await browser.post('/passkeys/remove', { csrf, credential: 'credential-2' })).status, 409)
      assert.equal((await browser.post('/passkeys/remove', { csrf, credential: 'credential-1' })).status, 200)
      assert.deepEqual(
        (await store.listPasskeys()).map(([id]) => id),
        ['credential-2'],
      )
    } finally {
      await latch.close()
    }
  })

  it('refuses a sign-in with a passkey made for another host name, as its page says', async () => {
    const store = new MemoryStore()
    const { latch, browser } = await signedInOnStore(store)
    try {
      const credential = createCredential(ES256)
      assert.equal((await addPasskey(latch, browser, credential, 'Old')).status, 200)
      const [[id, passkey]] = await store.listPasskeys()
      await store.savePasskey(id, { ...passkey, rpId: 'old.example' }, Date.now()) // as if ISSUER had changed since
      await signOut(browser)
      const refused = await signInWithPasskey(latch, browser, credential)
      assert.equal(refused.status, 401)
      assert.match(await refused.text(), /made for old\.example/)
      assert.equal(browser.cookies.has('latch_session'), false)
      assert.equal((await store.findPasskey(id))?.rpId, 'old.example')
    } finally {
      await latch.close()
    }
  })

  it('adds a passkey once when its form is sent twice at once, and answers both without a refusal', async () => {
    const file = join(await mkdtemp(join(tmpdir(), 'latch-passkey-twice-')), 'data.jsonl')
    const store = await FileStore.open(file, { log: () => {} }) // a write that takes a while, as on a disk
    const { latch, browser } = await signedInOnStore(store)
    try {
      const fields = await additionFields(latch, browser, createCredential(ES256), 'Phone')
      const answers = await Promise.all([1, 2, 3].map(() => browser.post('/passkeys/add', fields)))
      assert.deepEqual(
        answers.map((answer) => answer.status),
        [200, 200, 200],
      )
      const pages = await Promise.all(answers.map((answer) => answer.text()))
      assert.equal(pages.filter((page) => /Added the passkey/.test(page)).length, 1)
      assert.equal(pages.filter((page) => /That passkey was added before\./.test(page)).length, 2)
      assert.equal((await store.listPasskeys()).length, 1)
      assert.deepEqual(
        latch.logs.filter((line) => /passkey was not added/.test(line)),
        [],
      )
    } finally {
      await latch.close()
      await store.close()
    }
  })

  it('keeps the last passkey when two removals race while password sign-in is off', async () => {
    const file = join(await mkdtemp(join(tmpdir(), 'latch-passkey-race-')), 'data.jsonl')
    const store = await FileStore.open(file, { log: () => {} })
    const { latch, browser } = await signedInWithPasskeysOnly(store, [{}, {}])
    try {
      const csrf = await formToken(browser)
      const [first, second] = await Promise.all([
        browser.post('/passkeys/remove', { csrf, credential: 'credential-1' }),
        browser.post('/passkeys/remove', { csrf, credential: 'credential-2' }),
      ])
      assert.deepEqual([first.status, second.status].sort(), [200, 409])
      assert.equal((await store.listPasskeys()).length, 1)
    } finally {
      await latch.close()
      await store.close()
    }
  })

  /**
   * The owner's passkey, added under ME to a store of the test's own; then `change` made to the
   * store, and Latch started on it again with another ME.
   */
  async function passkeyThenNewMe(change: (store: MemoryStore) => Promise<void> = async () => {}) {
    const store = new MemoryStore()
    const passwordHash = await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 })
    const owner = createCredential(ES256)
    const before = await startTestLatch({ HOST: 'localhost', ME, PASSWORD_HASH: passwordHash }, { store })
    try {
      const browser = openBrowser(before)
      await signInWithPassword(browser)
      assert.equal((await addPasskey(before, browser, owner, 'Phone')).status, 200)
    } finally {
      await before.close()
    }
    await change(store)
    const moved = await startTestLatch(
      { HOST: 'localhost', ME: 'https://moved.example/', PASSWORD_HASH: passwordHash },
      { store },
    )
    return { store, owner, moved }
  }

  it('keeps a passkey working after ME changes: its user handle is the one it was made with', async () => {
    const { owner, moved } = await passkeyThenNewMe()
    try {
      const browser = openBrowser(moved)
      const signedIn = await browser.post('/sign-in', await passkeyFields(moved, browser, owner))
      assert.equal(signedIn.status, 303, await signedIn.text())
      // the handle is still checked, against the one the passkey was made with
      const stranger = openBrowser(moved)
      const fields = { ...(await passkeyFields(moved, stranger, owner)), user_handle: base64url(Buffer.alloc(16)) }
      const refused = await stranger.post('/sign-in', fields)
      assert.equal(refused.status, 401)
      assert.match(await refused.text(), /the passkey is not the owner of this server/)
    } finally {
      await moved.close()
    }
  })

  it('lets a passkey stored before its handle was kept sign in after ME changes, and no forged handle lock it out', async () => {
    const { store, owner, moved } = await passkeyThenNewMe(async (store) => {
      const [[id, { userHandle: _, rpId: __, ...old }]] = await store.listPasskeys() // as a passkey stored before was
      await store.savePasskey(id, old, 0)
    })
    try {
      const browser = openBrowser(moved)
      // the handle is not signed: whoever holds an assertion can send any
      const forged = { ...(await passkeyFields(moved, browser, owner)), user_handle: 'AAAA' }
      assert.equal((await browser.post('/sign-in', forged)).status, 303)
      const other = openBrowser(moved)
      const signedIn = await other.post('/sign-in', await passkeyFields(moved, other, owner))
      assert.equal(signedIn.status, 303, await signedIn.text())
      const [[, kept]] = await store.listPasskeys()
      assert.deepEqual([kept.userHandle, kept.rpId], [undefined, 'localhost']) // not the handle Latch makes now
    } finally {
      await moved.close()
    }
  })

  it('refuses a sign-in without the user handle, and one that says it ran under another top origin', async () => {
    const latch = await startLatch()
    try {
      const owner = createCredential(ES256)
      const browser = openBrowser(latch)
      await signInWithPassword(browser)
      assert.equal((await addPasskey(latch, browser, owner, 'Phone')).status, 200)
      await signOut(browser)
      const { user_handle: _, ...withoutHandle } = await passkeyFields(latch, browser, owner)
      const refused = await browser.post('/sign-in', withoutHandle)
      assert.equal(refused.status, 401)
      assert.match(await refused.text(), /the passkey is not the owner of this server/)
      const options = await askChallenge(browser, 'sign-in')
      const framed = Buffer.from(
        JSON.stringify({
          type: 'webauthn.get',
          challenge: options.challenge,
          origin: latch.issuer,
          topOrigin: 'https://evil.example',
        }),
      )
      assert.throws(
        () =>
          verifyAuthentication(
            { clientDataJSON: framed, authenticatorData: Buffer.alloc(37), signature: Buffer.alloc(0) },
            {
              challenge: options.challenge,
              origin: latch.issuer,
              rpId: 'localhost',
              publicKey: '',
              algorithm: ES256,
              counter: 0,
            },
          ),
        /the ceremony ran in a frame of another origin/,
      )
    } finally {
      await latch.close()
    }
  })
})

describe('Keys and data that only a forger would send', () => {
  it('refuses an RSA key whose exponent is not 65537, or longer than 4,096 bits', () => {
    const rsaCose = (bits: number, publicExponent: number) => {
      const { publicKey } = generateKeyPairSync('rsa', { modulusLength: bits, publicExponent })
      const jwk = publicKey.export({ format: 'jwk' })
      return new Map<number, unknown>([
        [1, 3],
        [3, RS256],
        [-1, Buffer.from(jwk.n ?? '', 'base64url')],
        [-2, Buffer.from(jwk.e ?? '', 'base64url')],
      ])
    }
    assert.equal(readCoseKey(rsaCose(2048, 65537)).algorithm, RS256)
    assert.throws(() => readCoseKey(rsaCose(2048, 3)), /exponent 65537/)
    assert.throws(() => readCoseKey(rsaCose(4160, 65537)), /2048 to 4096 bits/)
  })

  it('refuses an Ed25519 key of small order, with which a signature made without a private key verifies', () => {
    const identity = Buffer.alloc(32)
    identity[0] = 1
    const forged = Buffer.concat([identity, Buffer.alloc(32)]) // R the identity point, S zero
    const weak = createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: base64url(identity) }, format: 'jwk' })
    // OpenSSL 3.0 (Node 20, and older Node 22) verifies it; OpenSSL 3.5 refuses such a key itself
    if (process.versions.openssl.startsWith('3.0.'))
      assert.equal(verify(null, Buffer.from('any message'), weak, forged), true)
    const smallOrder = [
      '0000000000000000000000000000000000000000000000000000000000000000',
      '0100000000000000000000000000000000000000000000000000000000000000',
      '26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05',
      'c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a',
      'ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f',
      'edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f',
      'eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f',
    ]
    for (const hexText of smallOrder)
      for (const signBit of [0, 0x80]) {
        const x = Buffer.from(hexText, 'hex')
        x[31] |= signBit
        const key = new Map<number, unknown>([
          [1, 1],
          [3, EDDSA],
          [-1, 6],
          [-2, x],
        ])
        assert.throws(() => readCoseKey(key), /small order/, x.toString('hex'))
      }
    assert.equal(readCoseKey(coseKey(createCredential(EDDSA))).algorithm, EDDSA)
  })

  it('refuses an Ed25519 key that is no point of the curve, with which no signature could ever verify', () => {
    const okp = (x: Buffer) =>
      new Map<number, unknown>([
        [1, 1],
        [3, EDDSA],
        [-1, 6],
        [-2, x],
      ])
    const y = (value: number, signBit = 0) => {
      const x = Buffer.alloc(32)
      x[0] = value
      x[31] |= signBit
      return x
    }
    // y = 2: x² = 3 / (4d + 1), which is no square modulo p (RFC 8032 §5.1.3, step 3)
    for (const signBit of [0, 0x80]) assert.throws(() => readCoseKey(okp(y(2, signBit))), /not a point of the curve/)
    // y = p + 2, written past p: no point is written so
    const pastP = Buffer.from('efffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f', 'hex')
    assert.throws(() => readCoseKey(okp(pastP)), /not a point of the curve/)
    // the base point (y = 4/5), and y = 3, which is one
    const base = Buffer.from('5866666666666666666666666666666666666666666666666666666666666666', 'hex')
    assert.equal(readCoseKey(okp(base)).algorithm, EDDSA)
    assert.equal(readCoseKey(okp(y(3))).algorithm, EDDSA)
    for (let i = 0; i < 20; i++) assert.equal(readCoseKey(coseKey(createCredential(EDDSA))).algorithm, EDDSA)
  })

  it('refuses an even RSA modulus, whose private exponent anyone can work out', () => {
    const rsa = (modulus: bigint) =>
      new Map<number, unknown>([
        [1, 3],
        [3, RS256],
        [-1, Buffer.from(modulus.toString(16).padStart(Math.ceil(modulus.toString(16).length / 2) * 2, '0'), 'hex')],
        [-2, Buffer.from([1, 0, 1])],
      ])
    const mersenne = (1n << 2203n) - 1n // prime
    assert.throws(() => readCoseKey(rsa(mersenne + 1n)), /modulus is even/)
    assert.equal(readCoseKey(rsa(((1n << 1279n) - 1n) * mersenne)).algorithm, RS256) // two primes: a real modulus
  })

  it('refuses an overlong RSA exponent or modulus before node:crypto spends time on it', () => {
    const real = coseKey(createCredential(RS256))
    const withExponent = (e: Buffer) => new Map([...real, [-2, e]])
    /** The median time of five refusals, in nanoseconds. */
    const timeRefusal = (key: unknown, message: RegExp) => {
      const times = [1, 2, 3, 4, 5].map(() => {
        const start = process.hrtime.bigint()
        assert.throws(() => readCoseKey(key), message)
        return Number(process.hrtime.bigint() - start)
      })
      return times.sort((a, b) => a - b)[2]
    }
    const small = timeRefusal(withExponent(Buffer.from([3])), /exponent 65537/) // node:crypto reads it, then it is refused
    const long = timeRefusal(withExponent(Buffer.alloc(45_000, 0xff)), /exponent 65537/)
    assert.ok(long < small * 10, `an exponent of 45,000 bytes took ${long} ns, one of one byte ${small} ns`)
    assert.throws(() => readCoseKey(new Map([...real, [-1, Buffer.alloc(514, 0xff)]])), /2048 to 4096 bits/)
  })

  it('refuses extensions that are not a CBOR map', () => {
    const head = Buffer.concat([createHash('sha256').update('localhost').digest(), Buffer.from([0x85, 0, 0, 0, 1])])
    assert.equal(readAuthenticatorData(Buffer.concat([head, Buffer.from([0xa0])])).counter, 1)
    assert.throws(
      () => readAuthenticatorData(Buffer.concat([head, Buffer.from([0x01])])),
      /extensions are not a CBOR map/,
    )
  })
})

describe('A passkey answer and a clock set back', () => {
  it('refuses a sign-in replayed once its challenge expired, though the clock is then set back', async () => {
    const latch = await startLatch()
    try {
      const { browser, fields } = await syncedPasskeyAnswer(latch)
      assert.equal((await browser.post('/sign-in', fields)).status, 303)
      browser.cookies.delete('latch_session') // signed out, the same CSRF cookie
      assert.equal((await browser.post('/sign-in', fields)).status, 401) // used
      latch.advance(400) // past the challenge's five minutes
      assert.equal((await browser.post('/sign-in', fields)).status, 401) // expired, and no longer kept as used
      latch.advance(-600) // the system clock set back ten minutes
      assert.equal((await browser.post('/sign-in', fields)).status, 401)
      assert.equal(browser.cookies.has('latch_session'), false)
    } finally {
      await latch.close()
    }
  })
})
