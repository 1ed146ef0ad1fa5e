//! `--web-config-file`: TLS, basic authentication and extra response headers, in the
//! format of Prometheus' exporter-toolkit (the file node exporters take), read once at
//! start. Any key this exporter does not know or cannot honour is refused: a setting
//! silently ignored would leave the operator believing in a protection that is not there.
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: server.crt        # relative paths are relative to this file's directory
//!   key_file: server.key
//!   client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default),
//!                                                  # VerifyClientCertIfGiven
//!   client_ca_file: clients.crt
//!   min_version: TLS12           # TLS12 (default) or TLS13; max_version likewise
//! basic_auth_users:
//!   prometheus: $2y$10$...       # bcrypt hashes
//! http_server_config:
//!   headers:
//!     Strict-Transport-Security: max-age=31536000
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use hyper::header::{HeaderName, HeaderValue};
use tokio_rustls::rustls;
use yaml_rust2::{Yaml, YamlLoader};

/// What the file asks for.
#[derive(Default)]
pub struct WebConfig {
    /// Serve TLS with this configuration (else plain HTTP).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Client certificates are required and verified.
    pub verifies_clients: bool,
    /// Basic authentication: user name → bcrypt hash (none: no authentication).
    pub users: BTreeMap<String, String>,
    /// Headers added to every response.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// The headers exporter-toolkit lets a configuration set, with the values it allows
/// (empty: any).
const ALLOWED_HEADERS: [(&str, &[&str]); 5] = [
    ("Strict-Transport-Security", &[]),
    ("X-Content-Type-Options", &["nosniff"]),
    ("X-Frame-Options", &["deny", "sameorigin"]),
    ("X-XSS-Protection", &[]),
    ("Content-Security-Policy", &[]),
];

/// The file at `path`, checked; the error is one line naming the file and what is wrong.
pub fn load(path: &Path) -> Result<WebConfig, String> {
    let fail = |what: String| format!("--web-config-file {}: {what}", path.display());
    let text = read_text(path).map_err(&fail)?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse(&text, base).map_err(|e| fail(one_line(&e)))
}

fn read_text(path: &Path) -> Result<String, String> {
    let bytes = crate::tls::read_file(path)?;
    String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The configuration in `text`; relative file names are taken from `base`.
pub fn parse(text: &str, base: &Path) -> Result<WebConfig, String> {
    let documents = YamlLoader::load_from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    if documents.len() > 1 {
        return Err("more than one YAML document".into());
    }
    let mut config = WebConfig::default();
    let top = match documents.first() {
        None | Some(Yaml::Null) => return Ok(config),
        Some(top) => map(top, "the file")?,
    };
    for (key, value) in top {
        match key.as_str() {
            "tls_server_config" => {
                let (tls, verifies_clients) = tls(value, base)?;
                config.tls = Some(tls);
                config.verifies_clients = verifies_clients;
            }
            "basic_auth_users" => config.users = users(value)?,
            "http_server_config" => config.headers = http_server(value)?,
            other => {
                return Err(format!(
                    "unknown key {other:?} (known: tls_server_config, basic_auth_users, \
                     http_server_config)"
                ));
            }
        }
    }
    Ok(config)
}

/// The (key, value) pairs of a mapping with string keys; `what` names it in errors.
fn map<'a>(yaml: &'a Yaml, what: &str) -> Result<Vec<(String, &'a Yaml)>, String> {
    match yaml {
        Yaml::Null => Ok(Vec::new()),
        Yaml::Hash(hash) => hash
            .iter()
            .map(|(k, v)| match k {
                Yaml::String(k) => Ok((k.clone(), v)),
                other => Err(format!("{what}: a key that is not a string ({other:?})")),
            })
            .collect(),
        other => Err(format!("{what} must be a mapping, not {}", kind(other))),
    }
}

fn kind(yaml: &Yaml) -> &'static str {
    match yaml {
        Yaml::Real(_) | Yaml::Integer(_) => "a number",
        Yaml::String(_) => "a string",
        Yaml::Boolean(_) => "a boolean",
        Yaml::Array(_) => "a list",
        Yaml::Hash(_) => "a mapping",
        Yaml::Alias(_) => "an alias",
        Yaml::Null => "empty",
        Yaml::BadValue => "a bad value",
    }
}

fn string(yaml: &Yaml, what: &str) -> Result<String, String> {
    match yaml {
        Yaml::String(s) => Ok(s.clone()),
        other => Err(format!("{what} must be a string, not {}", kind(other))),
    }
}

/// The TLS configuration, and whether it requires verified client certificates.
fn tls(yaml: &Yaml, base: &Path) -> Result<(Arc<rustls::ServerConfig>, bool), String> {
    let mut cert_file = None;
    let mut key_file = None;
    let mut client_auth = "NoClientCert".to_string();
    let mut client_ca_file = None;
    let mut min_version = None;
    let mut max_version = None;
    for (key, value) in map(yaml, "tls_server_config")? {
        let what = format!("tls_server_config.{key}");
        match key.as_str() {
            "cert_file" => cert_file = Some(base.join(string(value, &what)?)),
            "key_file" => key_file = Some(base.join(string(value, &what)?)),
            "client_auth_type" => client_auth = string(value, &what)?,
            "client_ca_file" => client_ca_file = Some(base.join(string(value, &what)?)),
            "min_version" => min_version = Some(version(&string(value, &what)?, &what)?),
            "max_version" => max_version = Some(version(&string(value, &what)?, &what)?),
            other => {
                return Err(format!(
                    "unknown or unsupported key {other:?} in tls_server_config (supported: \
                     cert_file, key_file, client_auth_type, client_ca_file, min_version, \
                     max_version)"
                ));
            }
        }
    }
    let cert_file = cert_file.ok_or("tls_server_config needs cert_file")?;
    let key_file = key_file.ok_or("tls_server_config needs key_file")?;
    let min = min_version.unwrap_or(12);
    let max = max_version.unwrap_or(13);
    if min > max {
        return Err("tls_server_config: min_version is above max_version".into());
    }
    let versions: Vec<&'static rustls::SupportedProtocolVersion> =
        [(12, &rustls::version::TLS12), (13, &rustls::version::TLS13)]
            .into_iter()
            .filter(|(v, _)| (min..=max).contains(v))
            .map(|(_, p)| p)
            .collect();

    let provider = crate::tls::provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions)
        .map_err(|e| format!("tls_server_config: {e}"))?;
    let verify = match client_auth.as_str() {
        "NoClientCert" => None,
        "VerifyClientCertIfGiven" => Some(true),
        "RequireAndVerifyClientCert" => Some(false),
        "RequestClientCert" | "RequireAnyClientCert" => {
            return Err(format!(
                "client_auth_type {client_auth} (client certificates taken without \
                 verification) is not supported: use VerifyClientCertIfGiven or \
                 RequireAndVerifyClientCert with client_ca_file"
            ));
        }
        other => {
            return Err(format!(
                "client_auth_type {other:?} is not one of NoClientCert, \
                 VerifyClientCertIfGiven, RequireAndVerifyClientCert"
            ));
        }
    };
    let builder = match (verify, client_ca_file) {
        (None, None) => builder.with_no_client_auth(),
        (None, Some(_)) => {
            return Err(
                "client_ca_file is set but client_auth_type is NoClientCert: client \
                 certificates would not be checked"
                    .into(),
            );
        }
        (Some(_), None) => {
            return Err(format!(
                "client_auth_type {client_auth} needs client_ca_file"
            ));
        }
        (Some(optional), Some(ca_file)) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in crate::tls::certificates(&ca_file, "client_ca_file")? {
                roots
                    .add(ca)
                    .map_err(|e| format!("client_ca_file {}: {e}", ca_file.display()))?;
            }
            if roots.is_empty() {
                return Err(format!(
                    "client_ca_file {}: no PEM certificate in it",
                    ca_file.display()
                ));
            }
            let mut verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            );
            if optional {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .map_err(|e| format!("client_ca_file {}: {e}", ca_file.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config =
        crate::tls::server_config(builder, ("cert_file", &cert_file), ("key_file", &key_file))?;
    Ok((config, verify == Some(false)))
}

/// 12 or 13 for exporter-toolkit's version names; TLS 1.0 and 1.1 are refused.
fn version(name: &str, what: &str) -> Result<u8, String> {
    match name {
        "TLS12" => Ok(12),
        "TLS13" => Ok(13),
        "TLS10" | "TLS11" => Err(format!(
            "{what}: {name} is not supported (TLS 1.2 is the oldest served)"
        )),
        other => Err(format!("{what}: {other:?} is not one of TLS12, TLS13")),
    }
}

fn users(yaml: &Yaml) -> Result<BTreeMap<String, String>, String> {
    let mut users = BTreeMap::new();
    for (name, hash) in map(yaml, "basic_auth_users")? {
        let hash = string(hash, &format!("basic_auth_users.{name}"))?;
        if name.contains(':') {
            return Err(format!("basic_auth_users: user name {name:?} contains ':'"));
        }
        if hash.parse::<bcrypt::HashParts>().is_err() {
            return Err(format!(
                "basic_auth_users.{name}: not a bcrypt hash (make one with `htpasswd -nBC 10 \
                 {name}`, the part after ':')"
            ));
        }
        users.insert(name, hash);
    }
    Ok(users)
}

fn http_server(yaml: &Yaml) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    let mut headers = Vec::new();
    for (key, value) in map(yaml, "http_server_config")? {
        match key.as_str() {
            "headers" => {
                for (name, value) in map(value, "http_server_config.headers")? {
                    let value = string(value, &format!("http_server_config.headers.{name}"))?;
                    headers.push(header(&name, &value)?);
                }
            }
            // This server speaks HTTP/1.1 only; asking for HTTP/2 cannot be honoured.
            "http2" => match value {
                Yaml::Boolean(false) => {}
                _ => {
                    return Err("http_server_config.http2: only `false` is supported (the \
                                exporter serves HTTP/1.1)"
                        .into());
                }
            },
            other => {
                return Err(format!(
                    "unknown or unsupported key {other:?} in http_server_config (supported: \
                     headers, http2: false)"
                ));
            }
        }
    }
    Ok(headers)
}

fn header(name: &str, value: &str) -> Result<(HeaderName, HeaderValue), String> {
    let Some((canonical, allowed)) = ALLOWED_HEADERS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
    else {
        let names: Vec<&str> = ALLOWED_HEADERS.iter().map(|(n, _)| *n).collect();
        return Err(format!(
            "http_server_config.headers: {name:?} cannot be set (allowed: {})",
            names.join(", ")
        ));
    };
    if !allowed.is_empty() && !allowed.iter().any(|a| a.eq_ignore_ascii_case(value)) {
        return Err(format!(
            "http_server_config.headers.{canonical}: {value:?} is not one of {}",
            allowed.join(", ")
        ));
    }
    let value = HeaderValue::from_str(value)
        .map_err(|_| format!("http_server_config.headers.{canonical}: not a valid value"))?;
    let name = HeaderName::from_bytes(canonical.as_bytes())
        .map_err(|_| format!("http_server_config.headers: {name:?} is not a header name"))?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_plain_http_without_authentication() {
        let config = parse("", Path::new(".")).unwrap();
        assert!(config.tls.is_none() && config.users.is_empty() && config.headers.is_empty());
    }

    #[test]
    fn unknown_keys_are_refused() {
        for text in [
            "tls_server_confg: {}",
            "basic_auth_users: {a: b}",
            "http_server_config: {headers: {Authorization: x}}",
            "http_server_config: {http2: true}",
            "tls_server_config: {cert_file: a, key_file: b, cipher_suites: []}",
            "- a list",
            "a: [",
        ] {
            assert!(parse(text, Path::new(".")).is_err(), "{text}");
        }
    }
}
