//! TLS for the node services' servers (the exporter and the webhook): the serving
//! certificate and key read into rustls (on ring, TLS 1.2 and 1.3, HTTP/1.1 by ALPN), and
//! the accepting of one connection, which answers plain HTTP on the TLS port with a 400
//! that says why, as Go's servers do.
//!
//! It owns no policy: which versions and which client verification a server takes are
//! its own configuration's business (`exporter::web_config`, the webhook's flags).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;
use tokio_rustls::{TlsAcceptor, rustls::crypto::CryptoProvider};

/// The cryptography every server here uses (ring: no C toolchain beyond gcc).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The largest file a server reads (a certificate chain, a key, a web configuration: a
/// few KiB).
pub const MAX_FILE: u64 = 1 << 20;

/// The bytes of `path`, a regular file of at most [`MAX_FILE`] bytes (links followed, as
/// a mounted Secret's are). It is opened without waiting (a FIFO cannot hang the start)
/// and checked on the descriptor; the error says what is wrong, for the caller to put
/// after the file's name.
pub fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot open it ({e})"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read it ({e})"))?;
    if !meta.file_type().is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_FILE {
        return Err(format!("larger than {MAX_FILE} bytes"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it ({e})"))?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(format!("larger than {MAX_FILE} bytes"));
    }
    Ok(bytes)
}

/// The PEM certificates in `path` (a chain, the server's first); `what` names the file
/// in errors (`cert_file`, `--tls-cert`).
pub fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let fail = |e: String| format!("{what} {}: {e}", path.display());
    let pem = read_file(path).map_err(fail)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(e.to_string()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// The PEM private key in `path` (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(path: &Path, what: &str) -> Result<PrivateKeyDer<'static>, String> {
    let fail = |e: String| format!("{what} {}: {e}", path.display());
    let pem = read_file(path).map_err(fail)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| fail(e.to_string()))
}

/// The server configuration: `builder` (versions and client verification chosen) with the
/// certificate of `cert_file` and the key of `key_file`, speaking HTTP/1.1. The names
/// say which options the files came from.
pub fn server_config(
    builder: rustls::ConfigBuilder<rustls::ServerConfig, rustls::server::WantsServerCert>,
    (cert_what, cert_file): (&str, &Path),
    (key_what, key_file): (&str, &Path),
) -> Result<Arc<rustls::ServerConfig>, String> {
    let certs = certificates(cert_file, cert_what)?;
    let key = private_key(key_file, key_what)?;
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "{cert_what} {} and {key_what} {}: {e}",
            cert_file.display(),
            key_file.display()
        )
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A server configuration with TLS 1.2 and 1.3 and no client certificates.
pub fn plain_server_config(
    cert: (&str, &Path),
    key: (&str, &Path),
) -> Result<Arc<rustls::ServerConfig>, String> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth();
    server_config(builder, cert, key)
}

/// The TLS session of a new connection, or `None` when the client sent nothing within
/// `timeout`, failed the handshake, or spoke plain HTTP (answered with a 400 first).
pub async fn accept(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    timeout: Duration,
) -> Option<TlsStream<TcpStream>> {
    let mut first = [0u8; 1];
    match tokio::time::timeout(timeout, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return None,
    }
    // A TLS record starts with its type, 0x16 for a handshake.
    if first[0] != 0x16 {
        refuse_plain(stream).await;
        return None;
    }
    tokio::time::timeout(timeout, acceptor.accept(stream))
        .await
        .ok()?
        .ok()
}

/// Answers plain HTTP on the TLS port with a 400 that says why, then closes. What the
/// client sent so far is read first (a bounded amount), so that the close does not reset
/// the connection before the client reads the answer.
async fn refuse_plain(mut stream: TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut sent = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(100), stream.read(&mut sent)).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream
            .write_all(
                b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n\
                  Connection: close\r\n\r\nClient sent an HTTP request to an HTTPS server.\n",
            )
            .await?;
        stream.shutdown().await
    })
    .await;
}
