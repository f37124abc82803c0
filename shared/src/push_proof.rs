//! What binds a pushed step to the output its sender returned.
//!
//! A server that pushes its output to the next server also returns it to
//! the client, which keeps it for replay and spot checks. A liar could
//! return honest numbers to the client and push others on: the next
//! server's output would then disagree with any witness, and an honest
//! server would be blamed for its predecessor's lie. So every push carries
//! the sender's signature over the digest of the pushed payload (and the
//! session, step and position it is for); the receiver checks it before
//! it computes anything and returns it with its output. The client checks
//! the signature with the sender's peer id and compares the digest with
//! the output the sender returned to it:
//!
//! - a valid signature over another digest: the sender pushed something
//!   else than it returned, and it signed that: the sender lied;
//! - a missing or invalid signature: the receiver (which only takes pushes
//!   whose signature holds) lied about what it was sent.

use libp2p::identity::{Keypair, PublicKey};
use libp2p::PeerId;
use sha2::{Digest, Sha256};

use crate::session_token::SessionToken;
use crate::tensor::{TensorPayload, TensorView, WireDType};

/// Longest signature accepted (an Ed25519 one is 64 bytes).
pub const MAX_SIGNATURE_LEN: usize = 128;
/// Signatures cover this prefix first, so no other signed message of a
/// peer's key (its DHT record) can be passed off as a push's.
const SIGNING_DOMAIN: &[u8] = b"corolla push proof v1\0";

/// The SHA-256 of a hidden-state payload as it crosses the wire: dtype,
/// compression, shape and bytes, so equal digests mean equal tensors.
pub type PayloadDigest = [u8; 32];

/// A pushing server's signed statement of what it pushed.
#[derive(Clone, PartialEq, Eq)]
pub struct PushProof {
    pub digest: PayloadDigest,
    pub signature: Vec<u8>,
}

impl std::fmt::Debug for PushProof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PushProof({:02x}{:02x}{:02x}{:02x}.., {} signature bytes)",
            self.digest[0],
            self.digest[1],
            self.digest[2],
            self.digest[3],
            self.signature.len()
        )
    }
}

/// Which step of which session a proof is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushedStep {
    /// The receiving session's token.
    pub token: SessionToken,
    pub step_id: u32,
    pub start_position: u32,
}

/// Why a proof does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    #[error("the peer id {0} does not carry its public key (not an Ed25519 identity)")]
    NoPublicKey(PeerId),
    #[error("the signature is not the sender's")]
    BadSignature,
    #[error("the key cannot sign: {0}")]
    CannotSign(String),
}

/// The public key inside `peer`, when its id inlines it (Ed25519 ids do).
pub fn public_key_of(peer: &PeerId) -> Option<PublicKey> {
    let hash: &libp2p::multihash::Multihash<64> = peer.as_ref();
    // 0x00: the identity multihash, whose digest is the protobuf-encoded key.
    if hash.code() != 0 {
        return None;
    }
    PublicKey::try_decode_protobuf(hash.digest()).ok()
}

/// A server whose pushes a proof may speak for: its peer id and the key
/// inside it, decoded once (decoding an Ed25519 key decompresses a curve
/// point, about a quarter of a verification, on every hop of every step).
#[derive(Debug, Clone)]
pub struct PushSender {
    peer: PeerId,
    key: Option<PublicKey>,
}

impl PushSender {
    pub fn new(peer: PeerId) -> Self {
        PushSender {
            key: public_key_of(&peer),
            peer,
        }
    }

    pub fn peer(&self) -> PeerId {
        self.peer
    }
}

fn wire_digest(
    dtype: WireDType,
    compression: crate::Compression,
    shape: &[usize],
    data: &[u8],
) -> PayloadDigest {
    let mut hasher = Sha256::new();
    hasher.update([
        dtype.code(),
        compression.code(),
        u8::try_from(shape.len()).unwrap_or(u8::MAX),
    ]);
    for dim in shape {
        hasher.update((*dim as u64).to_le_bytes());
    }
    hasher.update(data);
    hasher.finalize().into()
}

/// The digest of a payload as it was (or will be) sent.
pub fn payload_digest(payload: &TensorPayload) -> PayloadDigest {
    wire_digest(
        payload.dtype,
        payload.compression,
        &payload.shape,
        &payload.data,
    )
}

/// The digest of a payload as it was received.
pub fn view_digest(view: &TensorView<'_>) -> PayloadDigest {
    wire_digest(view.dtype, view.compression, &view.shape, view.data)
}

fn signing_input(step: &PushedStep, digest: &PayloadDigest) -> Vec<u8> {
    let mut input = Vec::with_capacity(SIGNING_DOMAIN.len() + 16 + 8 + 32);
    input.extend_from_slice(SIGNING_DOMAIN);
    input.extend_from_slice(&step.token.0);
    input.extend_from_slice(&step.step_id.to_le_bytes());
    input.extend_from_slice(&step.start_position.to_le_bytes());
    input.extend_from_slice(digest);
    input
}

impl PushProof {
    /// The sender's statement that it pushes `payload` as `step`.
    pub fn sign(
        key: &Keypair,
        step: &PushedStep,
        payload: &TensorPayload,
    ) -> Result<Self, ProofError> {
        let digest = payload_digest(payload);
        let signature = key
            .sign(&signing_input(step, &digest))
            .map_err(|e| ProofError::CannotSign(e.to_string()))?;
        Ok(PushProof { digest, signature })
    }

    /// Whether `sender` signed this proof for `step`.
    pub fn verify(&self, sender: &PushSender, step: &PushedStep) -> Result<(), ProofError> {
        let key = sender
            .key
            .as_ref()
            .ok_or(ProofError::NoPublicKey(sender.peer))?;
        if key.verify(&signing_input(step, &self.digest), &self.signature) {
            Ok(())
        } else {
            Err(ProofError::BadSignature)
        }
    }
}

/// Who a push proof shows lied, if anyone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushVerdict {
    /// The receiver computed on exactly what the sender returned.
    Consistent,
    /// The sender signed a push of other numbers than it returned.
    SenderLied,
    /// The receiver's proof is missing or not the sender's.
    ReceiverLied(String),
}

/// Judges a receiver's `proof` for `step`, against the digest of what
/// `sender` returned to the client.
pub fn judge(
    proof: Option<&PushProof>,
    sender: &PushSender,
    step: &PushedStep,
    returned: &PayloadDigest,
) -> PushVerdict {
    let Some(proof) = proof else {
        return PushVerdict::ReceiverLied(
            "a pushed step's output came without its push proof".into(),
        );
    };
    match proof.verify(sender, step) {
        Err(e) => PushVerdict::ReceiverLied(format!("its push proof does not hold: {e}")),
        Ok(()) if proof.digest == *returned => PushVerdict::Consistent,
        Ok(()) => PushVerdict::SenderLied,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(fill: u8) -> TensorPayload {
        TensorPayload::new(WireDType::F32, vec![1, 2, 2], vec![fill; 16]).unwrap()
    }

    fn step() -> PushedStep {
        PushedStep {
            token: SessionToken([7; 16]),
            step_id: 3,
            start_position: 11,
        }
    }

    #[test]
    fn a_proof_holds_only_for_its_signer_step_and_payload() {
        let sender = Keypair::generate_ed25519();
        let sender_id = PushSender::new(sender.public().to_peer_id());
        let honest = payload(1);
        let proof = PushProof::sign(&sender, &step(), &honest).unwrap();
        proof.verify(&sender_id, &step()).unwrap();
        let returned = payload_digest(&honest);
        assert_eq!(
            judge(Some(&proof), &sender_id, &step(), &returned),
            PushVerdict::Consistent
        );
        assert_eq!(view_digest(&honest.view()), returned);

        // The sender pushed (and signed) other numbers than it returned.
        let other = payload_digest(&payload(2));
        assert_eq!(
            judge(Some(&proof), &sender_id, &step(), &other),
            PushVerdict::SenderLied
        );

        // A receiver cannot pass a proof off as another peer's, step's or session's.
        let stranger = PushSender::new(Keypair::generate_ed25519().public().to_peer_id());
        assert!(matches!(
            judge(Some(&proof), &stranger, &step(), &returned),
            PushVerdict::ReceiverLied(_)
        ));
        for other_step in [
            PushedStep {
                step_id: 4,
                ..step()
            },
            PushedStep {
                start_position: 12,
                ..step()
            },
            PushedStep {
                token: SessionToken([8; 16]),
                ..step()
            },
        ] {
            assert!(matches!(
                judge(Some(&proof), &sender_id, &other_step, &returned),
                PushVerdict::ReceiverLied(_)
            ));
        }
        // Nor forge the digest under the sender's signature, nor leave the proof out.
        let forged = PushProof {
            digest: other,
            ..proof.clone()
        };
        assert!(matches!(
            judge(Some(&forged), &sender_id, &step(), &other),
            PushVerdict::ReceiverLied(_)
        ));
        assert!(matches!(
            judge(None, &sender_id, &step(), &returned),
            PushVerdict::ReceiverLied(_)
        ));
    }

    #[test]
    fn digests_tell_shapes_dtypes_and_compressions_apart() {
        let a = payload(1);
        let mut reshaped = a.clone();
        reshaped.shape = vec![1, 4, 1];
        let mut retyped = a.clone();
        retyped.dtype = WireDType::BF16;
        let compressed = TensorPayload::new(WireDType::F32, vec![1, 1, 64], vec![0; 256])
            .unwrap()
            .compressed(crate::Compression::Int8Block64);
        let plain = TensorPayload::new(WireDType::F32, vec![1, 1, 64], vec![0; 256]).unwrap();
        let digests = [
            payload_digest(&a),
            payload_digest(&reshaped),
            payload_digest(&retyped),
            payload_digest(&compressed),
            payload_digest(&plain),
        ];
        for (i, x) in digests.iter().enumerate() {
            for y in &digests[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }

    #[test]
    fn only_ids_that_inline_their_key_can_be_checked() {
        let id = Keypair::generate_ed25519().public().to_peer_id();
        assert!(public_key_of(&id).is_some());
        // A hashed id (as RSA keys get) names no key.
        let hashed = libp2p::multihash::Multihash::<64>::wrap(0x12, &[9; 32]).unwrap();
        let hashed = PeerId::from_multihash(hashed).unwrap();
        assert!(public_key_of(&hashed).is_none());
        let proof = PushProof::sign(&Keypair::generate_ed25519(), &step(), &payload(1)).unwrap();
        assert_eq!(
            proof.verify(&PushSender::new(hashed), &step()),
            Err(ProofError::NoPublicKey(hashed))
        );
    }
}
