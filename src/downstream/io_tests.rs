//! [`Prefixed`] over TLS with a client that reads nothing.

use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// A TLS pair on loopback: tessera's side with a 4 KiB send buffer (fixed, not tuned by the
/// kernel), the client's with a 4 KiB receive buffer; the client side is returned to be kept
/// and never read.
async fn tls_pair() -> (
    TlsStream<TcpStream>,
    tokio_rustls::client::TlsStream<TcpStream>,
) {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let cert = made.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::try_from(made.signing_key.serialize_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.set_nonblocking(true).unwrap();
    let connecting = tokio::net::TcpSocket::from_std_stream(socket.into()).connect(addr);
    let (tcp, accepted) = tokio::join!(connecting, listener.accept());
    let (server_tcp, _) = accepted.unwrap();
    socket2::SockRef::from(&server_tcp)
        .set_send_buffer_size(4096)
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let (server_tls, client_tls) = tokio::join!(
        tokio_rustls::TlsAcceptor::from(Arc::new(server)).accept(server_tcp),
        tokio_rustls::TlsConnector::from(Arc::new(client)).connect(name, tcp.unwrap()),
    );
    (server_tls.unwrap(), client_tls.unwrap())
}

/// TLS takes bytes into its buffer as written while the socket takes none: the flush, and the
/// close after it, are what wait on the client, and they too end with the send timeout.
#[tokio::test]
async fn a_flush_the_client_never_takes_times_out() {
    let (server, _client) = tls_pair().await;
    let mut io = Prefixed {
        pre: Bytes::new(),
        io: server,
        linger: None,
        lingers: false,
        send_timeout: Duration::from_millis(200),
        stall: Stall::default(),
        stalled: false,
        reset: Arc::new(AtomicBool::new(false)),
    };
    // More than the two 4 KiB buffers hold, less than rustls buffers (64 KiB).
    let mut written = 0;
    while written < 32 * 1024 {
        let n = tokio::time::timeout(Duration::from_secs(10), io.write(&[7u8; 4096]))
            .await
            .expect("a write TLS takes at once")
            .unwrap();
        written += n;
    }
    let flushed = tokio::time::timeout(Duration::from_secs(10), io.flush()).await;
    let err = flushed
        .expect("the send timeout ends the flush")
        .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert!(io.stalled);
}
