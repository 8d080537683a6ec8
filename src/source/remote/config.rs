//! Placeholder until the configuration chain lands: credentials from the environment only.

use std::path::{Path, PathBuf};

#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Config {
    pub endpoint: Option<String>,
    pub region: String,
    pub credentials: Option<Credentials>,
    pub path_style: bool,
    pub ca_bundle: Option<PathBuf>,
    pub credentials_from: String,
    pub endpoint_from: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, secret: <redacted>)", self.access_key)
    }
}

pub fn resolve(
    env: &dyn Fn(&str) -> Option<String>,
    _home: Option<&Path>,
    no_sign: bool,
) -> Result<S3Config, String> {
    let credentials = match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
        (Some(a), Some(s)) if !no_sign => Some(Credentials {
            access_key: a,
            secret_key: s,
            session_token: env("AWS_SESSION_TOKEN"),
        }),
        _ => None,
    };
    let endpoint = env("AWS_ENDPOINT_URL_S3").or_else(|| env("AWS_ENDPOINT_URL"));
    Ok(S3Config {
        path_style: endpoint.is_some(),
        endpoint,
        region: env("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
        credentials,
        ca_bundle: env("AWS_CA_BUNDLE").map(PathBuf::from),
        credentials_from: "environment (AWS_ACCESS_KEY_ID)".into(),
        endpoint_from: "AWS_ENDPOINT_URL".into(),
    })
}
