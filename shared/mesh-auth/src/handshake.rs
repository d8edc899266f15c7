//! The mutual challenge-response as wire messages, one state machine per side.
//!
//! ```text
//! client                                   server
//!   AuthHello { channel, client_nonce }  ->
//!                                        <-  AuthChallenge { server_nonce, server_proof }
//!   (checks server_proof)
//!   AuthProof { client_proof }           ->
//!                                        <-  Ack | Error(Unauthenticated)
//! ```
//!
//! `server_proof = HMAC(secret, "server" | channel | client_nonce | server_nonce)` and
//! `client_proof` the same with `"client"`: each side's proof covers the other side's fresh
//! nonce, so neither can be replayed on another connection, and the role label keeps a server
//! proof from being reflected back as a client proof.

use pdmesh_protocol::{AuthChallenge, AuthHello, AuthProof, ErrorClass, WireError};

use crate::{client_proof, nonce, nonce_ok, proofs_match, server_proof, Channel, MeshSecret, NONCE_LEN};

/// Why a handshake failed (the text is for logs; the peer gets only a refusal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthFailure {
    #[error("expected an auth_hello for {expected}, got one for {got:?}")]
    WrongChannel { expected: &'static str, got: String },
    #[error("nonce of {0} bytes (32 required)")]
    BadNonce(usize),
    #[error("the peer's proof does not match the mesh secret")]
    BadProof,
    #[error("the server did not prove knowledge of the mesh secret (another mesh, or an impostor)")]
    ServerNotInMesh,
    #[error("{0}")]
    Protocol(String),
}

/// The server's state between [`AuthChallenge`] and [`AuthProof`].
#[derive(Debug, Clone)]
pub struct ServerChallenge {
    channel: Channel,
    client_nonce: Vec<u8>,
    server_nonce: [u8; NONCE_LEN],
}

impl ServerChallenge {
    /// Answer a client's hello on `channel`: a fresh nonce and this server's proof.
    pub fn answer(
        secret: &MeshSecret,
        channel: Channel,
        hello: &AuthHello,
    ) -> Result<(Self, AuthChallenge), AuthFailure> {
        if hello.channel != channel.label() {
            return Err(AuthFailure::WrongChannel { expected: channel.label(), got: hello.channel.clone() });
        }
        if !nonce_ok(&hello.client_nonce) {
            return Err(AuthFailure::BadNonce(hello.client_nonce.len()));
        }
        let server_nonce = nonce();
        let proof = server_proof(secret, channel, &hello.client_nonce, &server_nonce);
        let challenge = AuthChallenge { server_nonce: server_nonce.to_vec(), server_proof: proof };
        Ok((Self { channel, client_nonce: hello.client_nonce.clone(), server_nonce }, challenge))
    }

    /// Check the client's proof for this connection (constant time).
    pub fn verify(&self, secret: &MeshSecret, proof: &AuthProof) -> Result<(), AuthFailure> {
        let expected = client_proof(secret, self.channel, &self.client_nonce, &self.server_nonce);
        if proofs_match(&expected, &proof.client_proof) {
            Ok(())
        } else {
            Err(AuthFailure::BadProof)
        }
    }
}

/// The client's state between [`AuthHello`] and the server's [`AuthChallenge`].
#[derive(Debug, Clone)]
pub struct ClientHello {
    channel: Channel,
    client_nonce: [u8; NONCE_LEN],
}

impl ClientHello {
    /// Start a handshake on `channel`: the hello to send first.
    pub fn new(channel: Channel) -> (Self, AuthHello) {
        let client_nonce = nonce();
        let hello = AuthHello { channel: channel.label().to_string(), client_nonce: client_nonce.to_vec() };
        (Self { channel, client_nonce }, hello)
    }

    /// Check the server's proof, and answer with ours. An impostor (no secret, or another
    /// mesh's) is refused here, before the client sends it anything that matters.
    pub fn answer(&self, secret: &MeshSecret, challenge: &AuthChallenge) -> Result<AuthProof, AuthFailure> {
        if !nonce_ok(&challenge.server_nonce) {
            return Err(AuthFailure::BadNonce(challenge.server_nonce.len()));
        }
        let expected = server_proof(secret, self.channel, &self.client_nonce, &challenge.server_nonce);
        if !proofs_match(&expected, &challenge.server_proof) {
            return Err(AuthFailure::ServerNotInMesh);
        }
        Ok(AuthProof { client_proof: client_proof(secret, self.channel, &self.client_nonce, &challenge.server_nonce) })
    }
}

/// The one refusal an unauthenticated peer gets, whatever it sent.
pub fn refusal(detail: &str) -> WireError {
    WireError::new(ErrorClass::Unauthenticated, format!("unauthenticated: {detail}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_agree_with_one_secret_and_refuse_with_another() {
        let k = MeshSecret::generate();
        let (client, hello) = ClientHello::new(Channel::TcpData);
        let (server, challenge) = ServerChallenge::answer(&k, Channel::TcpData, &hello).unwrap();
        let proof = client.answer(&k, &challenge).unwrap();
        assert_eq!(server.verify(&k, &proof), Ok(()));

        // A client with another secret refuses the real server, and the server refuses it.
        let other = MeshSecret::generate();
        assert_eq!(client.answer(&other, &challenge), Err(AuthFailure::ServerNotInMesh));
        let forged = AuthProof {
            client_proof: crate::client_proof(&other, Channel::TcpData, &hello.client_nonce, &challenge.server_nonce),
        };
        assert_eq!(server.verify(&k, &forged), Err(AuthFailure::BadProof));

        // A proof from one connection is worthless on the next (fresh server nonce).
        let (server2, _) = ServerChallenge::answer(&k, Channel::TcpData, &hello).unwrap();
        assert_eq!(server2.verify(&k, &proof), Err(AuthFailure::BadProof));

        // The server's own proof reflected back is not a client proof.
        let reflected = AuthProof { client_proof: challenge.server_proof.clone() };
        assert_eq!(server.verify(&k, &reflected), Err(AuthFailure::BadProof));

        // A hello for another channel, or with a short nonce, gets no challenge.
        assert!(matches!(
            ServerChallenge::answer(&k, Channel::SideChannel, &hello),
            Err(AuthFailure::WrongChannel { .. })
        ));
        let short = AuthHello { client_nonce: vec![0; 8], ..hello };
        assert_eq!(ServerChallenge::answer(&k, Channel::TcpData, &short).err(), Some(AuthFailure::BadNonce(8)));
    }
}
