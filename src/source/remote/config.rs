//! S3 endpoint, region, credentials and CA bundle for `s3://` archives, read from the environment
//! and `~/.aws/{credentials,config}` in the same order and INI dialect as botocore (boto3, aws).

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Access keys for signing requests.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    // Debug output lands in logs and bug reports: the key id only, never the secrets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = self
            .session_token
            .as_ref()
            .map(|_| format_args!("<redacted>"));
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .field("secret", &format_args!("<redacted>"))
            .field("session_token", &token)
            .finish()
    }
}

/// Where requests go and how they are signed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Config {
    /// Custom endpoint (scheme://host[:port][/path]) without a trailing slash; None: AWS's own (`https://s3.{region}.amazonaws.com`).
    pub endpoint: Option<String>,
    pub region: String,
    /// None: anonymous (unsigned requests).
    pub credentials: Option<Credentials>,
    /// Bucket in the path (`endpoint/bucket/key`) rather than the host name: always with a custom endpoint unless the config says `addressing_style = virtual`; for AWS only when `addressing_style = path`.
    pub path_style: bool,
    /// PEM file of CA certificates to trust instead of the system's.
    pub ca_bundle: Option<PathBuf>,
    /// For error messages: where the credentials came from, e.g. "environment (AWS_ACCESS_KEY_ID)", "profile lumi-465000001 in /home/u/.aws/credentials", "profile default in /home/u/.aws/config", "none (--no-sign-request)", "none found (looked in: environment, /home/u/.aws/credentials, /home/u/.aws/config)".
    pub credentials_from: String,
    /// Likewise for the endpoint: "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "profile X (services Y) in PATH", "profile X in PATH", "AWS default".
    pub endpoint_from: String,
}

/// A configuration botocore (and so the AWS CLI) would refuse too, or one archfs cannot
/// use: each says what to fix. Values are quoted by their first word only ([`first_word`]):
/// a value run on into the next line may hold a secret.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "AWS profile `{name}` (from {var}) is in neither {credentials} nor {config}; \
         run `aws configure --profile {name}` or unset {var}"
    )]
    NoProfile {
        name: String,
        var: &'static str,
        credentials: String,
        config: String,
    },
    #[error(
        "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not; set both, or unset \
         AWS_ACCESS_KEY_ID to use ~/.aws/credentials"
    )]
    NoSecretInEnvironment,
    #[error(
        "{from} has aws_access_key_id but no aws_secret_access_key; add it, or run \
         `aws configure --profile {name}`"
    )]
    NoSecret { from: String, name: String },
    #[error(
        "AWS profile `{name}` gets its credentials through `{key}`, which archfs cannot do; \
         export keys instead: eval \"$(aws configure export-credentials --profile {name} \
         --format env)\" (AWS CLI v2)"
    )]
    CredentialsThrough { name: String, key: &'static str },
    #[error(
        "AWS region `{0}` is not a region name like eu-west-1; fix AWS_REGION, \
         AWS_DEFAULT_REGION or the profile's `region`"
    )]
    BadRegion(String),
    #[error(
        "AWS profile `{name}` has `services = {services}` but {config} has no [services \
         {services}] section; add one (with an `s3 =` block holding `endpoint_url`) or \
         remove that line"
    )]
    NoServices {
        name: String,
        services: String,
        config: String,
    },
    #[error("endpoint URL `{url}` (from {from}) is not of the form https://host[:port]; fix it")]
    BadEndpoint { url: String, from: String },
    #[error("{} is not UTF-8 text; fix or remove it", .0.display())]
    NotUtf8(PathBuf),
    /// Never quoting the line: it may hold a secret.
    #[error(
        "{} line {line}: {what} (the AWS CLI rejects this file too); fix that line",
        path.display()
    )]
    Malformed {
        path: PathBuf,
        line: usize,
        what: String,
    },
}

impl From<ConfigError> for crate::error::Error {
    fn from(e: ConfigError) -> Self {
        crate::error::Error::Config(e.to_string())
    }
}

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;
/// The profile's keys, each with the file it came from.
type Profile<'a> = HashMap<&'a str, (&'a Val, &'a IniFile)>;

/// `env` looks up environment variables (tests pass a map; the program passes std::env::var). `home` is $HOME. `no_sign`: --no-sign-request (anonymous; still reads endpoint and region).
pub fn resolve(
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
    no_sign: bool,
) -> Result<S3Config, ConfigError> {
    // An empty variable counts as unset: botocore skips empty keys and endpoints too.
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    let creds_file = load(env, "AWS_SHARED_CREDENTIALS_FILE", "credentials", home)?;
    let conf_file = load(env, "AWS_CONFIG_FILE", "config", home)?;
    let (profiles, services) = profile_map(&conf_file);
    // AWS CLI v2's order; botocore alone reads AWS_DEFAULT_PROFILE first.
    let named = ["AWS_PROFILE", "AWS_DEFAULT_PROFILE"].map(|v| Some((v, var(v)?)));
    let named = named.into_iter().flatten().next();
    let name = named.as_ref().map_or("default", |(_, p)| p);
    let creds = creds_file.sections.iter().find(|(n, _)| n == name);
    let sections = [
        (profiles.get(name).copied(), &conf_file),
        (creds.map(|c| &c.1), &creds_file),
    ];
    if let (Some((v, _)), [(None, _), (None, _)]) = (&named, sections) {
        return Err(ConfigError::NoProfile {
            name: name.to_owned(),
            var: v,
            credentials: creds_file.shown.clone(),
            config: conf_file.shown.clone(),
        });
    }
    // As botocore merges them: a key in the credentials file beats the same key in the config file.
    let mut profile = Profile::new();
    for (section, file) in sections {
        profile.extend(
            section
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.as_str(), (v, file))),
        );
    }
    let text = |key: &str| {
        profile
            .get(key)
            .and_then(|(v, _)| v.text())
            .filter(|t| !t.is_empty())
    };
    // botocore checks credentials, then the region, then the endpoint: report errors in that order.
    let (credentials, credentials_from) = if no_sign {
        (None, "none (--no-sign-request)".into())
    } else {
        find_credentials(&var, name, &profile, sections)?
    };
    let region = var("AWS_REGION").or_else(|| var("AWS_DEFAULT_REGION"));
    let region = region
        .or(text("region").map(String::from))
        .unwrap_or("us-east-1".into());
    // botocore's validate_region_name; also catches a value run on by an indented next line.
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '-';
    if region.len() > 63
        || region.starts_with('-')
        || region.ends_with('-')
        || !region.chars().all(ok)
    {
        return Err(ConfigError::BadRegion(first_word(&region)));
    }
    let (endpoint, endpoint_from) = find_endpoint(&var, name, &profile, &services, &conf_file)?;
    // botocore's AWS_S3_FORCE_PATH_STYLE; the `s3 =` block is the profile's, not its services'.
    let style = match profile.get("s3") {
        Some((Val::Nested(s3), _)) => s3.get("addressing_style").map(String::as_str),
        _ => None,
    };
    let path_style = if endpoint.is_some() {
        style != Some("virtual")
    } else {
        style == Some("path")
    };
    let ca_bundle = var("AWS_CA_BUNDLE")
        .or(text("ca_bundle").map(String::from))
        .map(PathBuf::from);
    Ok(S3Config {
        endpoint,
        region,
        credentials,
        path_style,
        ca_bundle,
        credentials_from,
        endpoint_from,
    })
}

/// botocore's chain: environment; (unsupported:) roles and SSO; the credentials file;
/// (unsupported:) credential_process; the config file.
fn find_credentials(
    var: Env,
    name: &str,
    profile: &Profile,
    [(conf, conf_file), (creds, creds_file)]: [(Option<&Section>, &IniFile); 2],
) -> Result<(Option<Credentials>, String), ConfigError> {
    let from_env =
        static_keys(|k| var(&k.to_uppercase())).map_err(|()| ConfigError::NoSecretInEnvironment)?;
    if let Some(keys) = from_env {
        return Ok((Some(keys), "environment (AWS_ACCESS_KEY_ID)".into()));
    }
    let unsupported = |keys: &[&'static str]| match keys.iter().find(|k| profile.contains_key(*k)) {
        None => Ok(()),
        Some(&key) => Err(ConfigError::CredentialsThrough {
            name: name.to_owned(),
            key,
        }),
    };
    let in_file = |section: Option<&Section>, file: &IniFile| {
        let from = format!("profile {name} in {}", file.name());
        let get = |k: &str| section?.get(k)?.text().map(String::from);
        match static_keys(get) {
            Ok(keys) => Ok(keys.map(|keys| (Some(keys), from))),
            Err(()) => Err(ConfigError::NoSecret {
                from,
                name: name.to_owned(),
            }),
        }
    };
    unsupported(&[
        "role_arn",
        "web_identity_token_file",
        "sso_session",
        "sso_start_url",
    ])?;
    if let Some(found) = in_file(creds, creds_file)? {
        return Ok(found);
    }
    unsupported(&["credential_process"])?;
    let (c, f) = (creds_file.name(), conf_file.name());
    let none = format!("none found (looked in: environment, {c}, {f})");
    Ok(in_file(conf, conf_file)?.unwrap_or((None, none)))
}

/// botocore's static providers, which use the same key names (upper-cased in the environment).
/// Err: a key id without its secret (PartialCredentialsError); a secret alone is ignored.
fn static_keys(get: impl Fn(&str) -> Option<String>) -> Result<Option<Credentials>, ()> {
    let get = |k: &str| get(k).filter(|v| !v.is_empty());
    let Some(access_key) = get("aws_access_key_id") else {
        return Ok(None);
    };
    let secret_key = get("aws_secret_access_key").ok_or(())?;
    let session_token = get("aws_security_token").or_else(|| get("aws_session_token"));
    Ok(Some(Credentials {
        access_key,
        secret_key,
        session_token,
    }))
}

/// botocore's ConfiguredEndpointProvider, unless AWS_IGNORE_CONFIGURED_ENDPOINT_URLS or the profile
/// says to ignore configured endpoints.
fn find_endpoint(
    var: Env,
    name: &str,
    profile: &Profile,
    services: &Sections,
    conf_file: &IniFile,
) -> Result<(Option<String>, String), ConfigError> {
    let text = |key: &str| {
        profile
            .get(key)
            .and_then(|(v, _)| v.text())
            .filter(|t| !t.is_empty())
    };
    // As in botocore's config chains, the variable (even "false") hides the profile's value.
    let ignore = var("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS");
    if ignore
        .as_deref()
        .or(text("ignore_configured_endpoint_urls"))
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
    {
        return Ok((
            None,
            "AWS default (configured endpoint URLs ignored)".into(),
        ));
    }
    let from_env =
        ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"].map(|v| Some((var(v)?, v.to_string())));
    let mut found = from_env.into_iter().flatten().next();
    if let (None, Some(s)) = (&found, text("services")) {
        // botocore raises InvalidConfigError for a missing or empty services section.
        let Some(section) = services.get(s).filter(|sec| !sec.is_empty()) else {
            return Err(ConfigError::NoServices {
                name: name.to_owned(),
                services: first_word(s),
                config: conf_file.shown.clone(),
            });
        };
        if let Some(Val::Nested(s3)) = section.get("s3") {
            let url = s3.get("endpoint_url").filter(|u| !u.is_empty());
            let from = format!("profile {name} (services {s}) in {}", conf_file.name());
            found = url.map(|u| (u.clone(), from));
        }
    }
    if let (None, Some((_, file)), Some(url)) =
        (&found, profile.get("endpoint_url"), text("endpoint_url"))
    {
        found = Some((url.into(), format!("profile {name} in {}", file.name())));
    }
    let Some((url, from)) = found else {
        return Ok((None, "AWS default".into()));
    };
    // botocore's "Invalid endpoint" (ValueError), said before any request.
    let url = url.trim_end_matches('/');
    let lower = url.to_ascii_lowercase();
    let host = lower
        .strip_prefix("https://")
        .or_else(|| lower.strip_prefix("http://"));
    let odd = url.contains(|c: char| c.is_whitespace() || c.is_control());
    match host {
        Some(host) if !host.is_empty() && !host.starts_with('/') && !odd => {
            Ok((Some(url.into()), from))
        }
        _ => Err(ConfigError::BadEndpoint {
            url: first_word(url),
            from,
        }),
    }
}

/// A value quoted in an error: its first word only, as a value run on into the next line may hold
/// a secret.
fn first_word(s: &str) -> String {
    let word = s.split(char::is_whitespace).next().unwrap_or_default();
    let more = if word.len() < s.len() { "…" } else { "" };
    format!("{}{more}", word.escape_debug())
}

/// A value as botocore reads it: a string, or the indented `k = v` block under a `name =` line.
enum Val {
    Str(String),
    Nested(HashMap<String, String>),
}

impl Val {
    fn text(&self) -> Option<&str> {
        match self {
            Val::Str(s) => Some(s),
            Val::Nested(_) => None,
        }
    }
}

type Section = HashMap<String, Val>;
type Sections<'a> = HashMap<String, &'a Section>;

/// One shared file: its name as the user gave it, where that is (None: `~` with no home), and its
/// sections in order.
struct IniFile {
    shown: String,
    path: Option<PathBuf>,
    sections: Vec<(String, Section)>,
}

impl IniFile {
    fn name(&self) -> String {
        self.path
            .as_ref()
            .map_or(self.shown.clone(), |p| p.display().to_string())
    }
}

/// Reads the file `var` names (else `~/.aws/{default}`), `~` expanded; missing or unreadable: no
/// sections, as in botocore.
fn load(env: Env, var: &str, default: &str, home: Option<&Path>) -> Result<IniFile, ConfigError> {
    let shown = env(var)
        .filter(|v| !v.is_empty())
        .unwrap_or(format!("~/.aws/{default}"));
    let path = match shown.strip_prefix('~') {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => {
            home.map(|h| h.join(rest.trim_start_matches('/')))
        }
        _ => Some(PathBuf::from(&shown)),
    };
    let mut sections = Vec::new();
    // configparser skips a file it cannot open; text not UTF-8 is botocore's ConfigParseError.
    if let Some(Ok(bytes)) = path.as_ref().filter(|p| p.is_file()).map(std::fs::read) {
        let p = path.as_deref().unwrap_or(Path::new(""));
        let not_utf8 = |_| ConfigError::NotUtf8(p.to_owned());
        sections = parse_ini(&String::from_utf8(bytes).map_err(not_utf8)?, p)?;
    }
    Ok(IniFile {
        shown,
        path,
        sections,
    })
}

/// configparser.RawConfigParser as botocore uses it: `=` or `:` delimits, keys lower-cased, only
/// whole-line `#`/`;` comments, a line indented deeper than its key continues the value, duplicates
/// are errors, `[DEFAULT]`'s keys go into every section; then botocore reads a value that starts on
/// the next line as a block of `k = v` lines.
fn parse_ini(text: &str, path: &Path) -> Result<Vec<(String, Section)>, ConfigError> {
    let bad = |line: usize, what: &str| ConfigError::Malformed {
        path: path.to_owned(),
        line,
        what: what.to_owned(),
    };
    let mut raw: Vec<(String, Vec<(String, Lines)>)> = Vec::new();
    let (mut in_value, mut indent) = (false, 0);
    for (i, line) in text.trim_start_matches('\u{feff}').split('\n').enumerate() {
        let (n, line) = (i + 1, line.strip_suffix('\r').unwrap_or(line));
        let t = line.trim();
        let ind = line.chars().take_while(|c| c.is_whitespace()).count();
        if t.starts_with('#') || t.starts_with(';') || t.is_empty() && !in_value {
            continue;
        } else if in_value && (t.is_empty() || ind > indent) {
            let lines = raw
                .last_mut()
                .and_then(|(_, keys)| keys.last_mut())
                .expect("in a value");
            lines.1.push((n, t.into()));
            continue;
        }
        indent = ind;
        if let Some(end) = t.rfind(']').filter(|&e| t.starts_with('[') && e > 1) {
            let name = &t[1..end];
            match raw.iter().position(|(s, _)| s == name) {
                // [DEFAULT] may reopen; moved last, its keys are the ones `raw.last_mut()` finds.
                Some(i) if name == "DEFAULT" => {
                    let reopened = raw.remove(i);
                    raw.push(reopened);
                }
                Some(_) => return Err(bad(n, &format!("section [{name}] appears twice"))),
                None => raw.push((name.into(), Vec::new())),
            }
            in_value = false;
        } else if let Some((section, keys)) = raw.last_mut() {
            let Some(d) = t.find(['=', ':']) else {
                return Err(bad(n, "not `key = value`"));
            };
            let key = t[..d].trim_end().to_lowercase();
            if key.is_empty() || keys.iter().any(|(k, _)| *k == key) {
                return Err(bad(
                    n,
                    &format!("key `{key}` is empty or twice in [{section}]"),
                ));
            }
            keys.push((key, vec![(n, t[d + 1..].trim().into())]));
            in_value = true;
        } else {
            return Err(bad(n, "text before the first [section] header"));
        }
    }
    // [DEFAULT] is no section: its keys go into every section that lacks them.
    let defaults = match raw.iter().position(|(s, _)| s == "DEFAULT") {
        Some(i) => raw.remove(i).1,
        None => Vec::new(),
    };
    let mut out = Vec::new();
    for (name, mut keys) in raw {
        for default in &defaults {
            if !keys.iter().any(|(k, _)| *k == default.0) {
                keys.push(default.clone());
            }
        }
        let mut section = Section::new();
        for (key, lines) in keys {
            let text: Vec<_> = lines.iter().map(|(_, l)| l.as_str()).collect();
            let text = text.join("\n").trim_end().to_string();
            if !text.starts_with('\n') {
                section.insert(key, Val::Str(text));
                continue;
            }
            let mut block = HashMap::new();
            for (n, line) in lines.iter().skip(1).filter(|(_, l)| !l.is_empty()) {
                let what = format!("not `key = value` in the `{key} =` block");
                let (k, v) = line.split_once('=').ok_or_else(|| bad(*n, &what))?;
                block.insert(k.trim().to_string(), v.trim().to_string());
            }
            section.insert(key, Val::Nested(block));
        }
        out.push((name, section));
    }
    Ok(out)
}

/// A value's lines as read: (line number, trimmed text).
type Lines = Vec<(usize, String)>;

/// botocore's build_profile_map: `[profile NAME]`, `[default]`, `[services NAME]`; later wins.
fn profile_map(conf: &IniFile) -> (Sections<'_>, Sections<'_>) {
    let (mut profiles, mut services) = (HashMap::new(), HashMap::new());
    for (name, section) in &conf.sections {
        if name.starts_with("profile") {
            profiles.extend(second_word(name).map(|p| (p, section)));
        } else if name.starts_with("services") {
            services.extend(second_word(name).map(|s| (s, section)));
        } else if name == "default" {
            profiles.insert(name.clone(), section);
        }
    }
    (profiles, services)
}

/// The NAME of `profile NAME` if the header is two words, as botocore's shlex.split finds them;
/// quoting the whole name (`[profile "my name"]`) works, backslashes do not.
fn second_word(header: &str) -> Option<String> {
    let (_, rest) = header.split_once(char::is_whitespace)?;
    let rest = rest.trim();
    let quoted = ['"', '\'']
        .into_iter()
        .find_map(|q| rest.strip_prefix(q)?.strip_suffix(q));
    match quoted {
        Some(name) if !name.contains(['"', '\'']) => Some(name.into()),
        None if !rest.is_empty()
            && !rest.contains(|c: char| c.is_whitespace() || "\"'\\".contains(c)) =>
        {
            Some(rest.into())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A throwaway $HOME with `.aws/credentials` and `.aws/config` (unless empty); removed on drop.
    struct Home(PathBuf);

    fn home(credentials: &str, config: &str) -> Home {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("archfs-s3cfg-{}-{n}", std::process::id()));
        std::fs::create_dir_all(dir.join(".aws")).unwrap();
        for (name, text) in [("credentials", credentials), ("config", config)] {
            if !text.is_empty() {
                std::fs::write(dir.join(".aws").join(name), text).unwrap();
            }
        }
        Home(dir)
    }

    impl Drop for Home {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    type Vars<'a> = &'a [(&'a str, &'a str)];

    impl Home {
        fn run(&self, vars: Vars, no_sign: bool) -> Result<S3Config, String> {
            let map: HashMap<_, _> = vars.iter().map(|(k, v)| (*k, v.to_string())).collect();
            resolve(&|k| map.get(k).cloned(), Some(&self.0), no_sign).map_err(|e| e.to_string())
        }
        fn ok(&self, vars: Vars) -> S3Config {
            self.run(vars, false).unwrap()
        }
        fn err(&self, vars: Vars) -> String {
            self.run(vars, false).unwrap_err()
        }
        fn file(&self, name: &str) -> String {
            self.0.join(".aws").join(name).display().to_string()
        }
    }

    fn keys(c: &S3Config) -> (&str, &str, Option<&str>) {
        let c = c.credentials.as_ref().expect("credentials");
        (&c.access_key, &c.secret_key, c.session_token.as_deref())
    }

    const CREDS: &str = "[default]\naws_access_key_id = FKEY\naws_secret_access_key = FSECRET\n";
    const ENV: [(&str, &str); 3] = [
        ("AWS_ACCESS_KEY_ID", "EKEY"),
        ("AWS_SECRET_ACCESS_KEY", "ESECRET"),
        ("AWS_SESSION_TOKEN", "T"),
    ];

    #[test]
    fn environment_keys_beat_files() {
        let h = home(CREDS, "");
        let c = h.ok(&ENV);
        assert_eq!(keys(&c), ("EKEY", "ESECRET", Some("T")));
        assert_eq!(c.credentials_from, "environment (AWS_ACCESS_KEY_ID)");
        // botocore tries the legacy AWS_SECURITY_TOKEN first.
        let c = h.ok(&[ENV[0], ENV[1], ENV[2], ("AWS_SECURITY_TOKEN", "OLD")]);
        assert_eq!(keys(&c).2, Some("OLD"));
        // A lone secret is ignored; a lone key id is botocore's PartialCredentialsError.
        assert_eq!(keys(&h.ok(&ENV[1..])), ("FKEY", "FSECRET", None));
        assert!(h.err(&ENV[..1]).contains("AWS_SECRET_ACCESS_KEY is not"));
    }

    #[test]
    fn credentials_file_beats_config_file() {
        let conf = "[default]\naws_access_key_id = CK\naws_secret_access_key = CS\n\
                    aws_session_token = T\n";
        let h = home(CREDS, conf);
        let c = h.ok(&[]);
        assert_eq!(keys(&c), ("FKEY", "FSECRET", None));
        assert_eq!(
            c.credentials_from,
            format!("profile default in {}", h.file("credentials"))
        );
        let h = home(
            "[other]\naws_access_key_id = X\naws_secret_access_key = Y\n",
            conf,
        );
        let c = h.ok(&[]);
        assert_eq!(keys(&c), ("CK", "CS", Some("T")));
        assert_eq!(
            c.credentials_from,
            format!("profile default in {}", h.file("config"))
        );
        let h = home("[default]\naws_access_key_id = K\n", "");
        let e = h.err(&[]);
        assert!(e.contains("no aws_secret_access_key") && e.contains(&h.file("credentials")));
    }

    #[test]
    fn endpoint_precedence() {
        let conf = "[default]\nendpoint_url = https://all.example/\nservices = mine\n\
                    [services mine]\ns3 =\n  endpoint_url = https://svc.example\n";
        let h = home("", conf);
        let env = [
            ("AWS_ENDPOINT_URL_S3", "http://s3env:8333/"),
            ("AWS_ENDPOINT_URL", "http://env"),
        ];
        let got = |c: S3Config| (c.endpoint.unwrap_or_default(), c.endpoint_from);
        assert_eq!(
            got(h.ok(&env)),
            ("http://s3env:8333".into(), "AWS_ENDPOINT_URL_S3".into())
        );
        assert_eq!(
            got(h.ok(&env[1..])),
            ("http://env".into(), "AWS_ENDPOINT_URL".into())
        );
        let from = format!("profile default (services mine) in {}", h.file("config"));
        assert_eq!(got(h.ok(&[])), ("https://svc.example".into(), from));
        // A services section without an `s3 =` block falls through to the profile's endpoint_url.
        let h = home("", &conf.replace("s3 =", "sqs ="));
        let from = format!("profile default in {}", h.file("config"));
        assert_eq!(got(h.ok(&[])), ("https://all.example".into(), from));
        let c = home("", "").ok(&[]);
        assert_eq!(
            (c.endpoint, c.endpoint_from.as_str(), c.path_style),
            (None, "AWS default", false)
        );
    }

    #[test]
    fn ignore_configured_endpoint_urls() {
        let conf = "[default]\nendpoint_url = https://all.example\n";
        let env = [
            ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "TRUE"),
            ("AWS_ENDPOINT_URL_S3", "http://x"),
        ];
        assert_eq!(home("", conf).ok(&env).endpoint, None);
        let h = home(
            "",
            &format!("{conf}ignore_configured_endpoint_urls = true\n"),
        );
        assert_eq!(h.ok(&env[1..]).endpoint, None);
        // The variable's "false" hides the profile's "true".
        let c = h.ok(&[("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "false")]);
        assert_eq!(c.endpoint.as_deref(), Some("https://all.example"));
    }

    #[test]
    fn services_naming_a_missing_section() {
        let h = home("", "[default]\nservices = gone\n");
        let e = h.err(&[]);
        assert!(
            e.contains("`services = gone` but ~/.aws/config has no [services gone]"),
            "{e}"
        );
        assert!(
            h.run(&[("AWS_ENDPOINT_URL", "http://x")], false).is_ok(),
            "not read then"
        );
    }

    #[test]
    fn region_and_ca_bundle_chains() {
        let h = home(
            "",
            "[default]\nregion = eu-north-1\nca_bundle = /conf.pem\n",
        );
        let env = [
            ("AWS_REGION", "r1"),
            ("AWS_DEFAULT_REGION", "r2"),
            ("AWS_CA_BUNDLE", "/env.pem"),
        ];
        let got = |c: S3Config| {
            (
                c.region,
                c.ca_bundle.unwrap_or_default().display().to_string(),
            )
        };
        assert_eq!(got(h.ok(&env)), ("r1".into(), "/env.pem".into()));
        assert_eq!(got(h.ok(&env[1..2])), ("r2".into(), "/conf.pem".into()));
        assert_eq!(got(h.ok(&[])), ("eu-north-1".into(), "/conf.pem".into()));
        assert_eq!(got(home("", "").ok(&[])), ("us-east-1".into(), "".into()));
        // An indented line after `region =` continues its value, which botocore then rejects.
        let h = home(
            "",
            "[default]\nregion = eu-north-1\n  aws_secret_access_key = HIDDEN\n",
        );
        let e = h.err(&[]);
        assert!(
            e.contains("`eu-north-1…` is not a region") && !e.contains("HIDDEN"),
            "{e}"
        );
    }

    /// What lumio-conf (LUMI-O-tools, internal/toolConfig/aws_util.go) writes with `--configure-only
    /// aws`: go-ini's aligned keys in ~/.aws/credentials, `services` among them, and a [services]
    /// block appended to ~/.aws/config.
    #[test]
    fn lumio_conf_layout() {
        let creds =
            "[lumi-465000001]\naws_access_key_id     = 0123ABCD\naws_secret_access_key = s3cr3t\n\
                     services              = lumi-465000001\nproject_id            = 465000001\n\n";
        let conf =
            "[services lumi-465000001]\ns3           = \n  endpoint_url = https://lumidata.eu\n  \
                    multipart_chunksize = 15\n";
        let h = home(creds, conf);
        let c = h.ok(&[("AWS_PROFILE", "lumi-465000001")]);
        assert_eq!(
            (c.endpoint.as_deref(), c.region.as_str(), c.path_style),
            (Some("https://lumidata.eu"), "us-east-1", true)
        );
        assert_eq!(keys(&c), ("0123ABCD", "s3cr3t", None));
        let from = format!(
            "profile lumi-465000001 (services lumi-465000001) in {}",
            h.file("config")
        );
        assert_eq!(c.endpoint_from, from);
        assert_eq!(
            c.credentials_from,
            format!("profile lumi-465000001 in {}", h.file("credentials"))
        );
        // `--set-default aws:true` also writes the keys to [default], with original_name.
        let default =
            creds.replace("[lumi-465000001]", "[default]") + "original_name = lumi-465000001\n";
        let c = home(&default, conf).ok(&[]);
        assert_eq!(
            (c.endpoint.as_deref(), keys(&c).0),
            (Some("https://lumidata.eu"), "0123ABCD")
        );
    }

    #[test]
    fn choosing_the_profile() {
        let conf = "[profile default]\nregion = pd\n[profile a]\nregion = ra\n\
                    [profile   \"b c\"]\nregion = rb\n[ profile d ]\nregion = rd\n";
        let h = home(CREDS, conf);
        let both = [("AWS_PROFILE", "a"), ("AWS_DEFAULT_PROFILE", "b c")];
        assert_eq!(
            [
                h.ok(&[]).region,
                h.ok(&both).region,
                h.ok(&both[1..]).region
            ],
            ["pd", "ra", "rb"]
        );
        // botocore keeps the spaces inside the brackets, so `[ profile d ]` is no profile.
        let e = h.err(&[("AWS_PROFILE", "d")]);
        assert_eq!(
            e,
            "AWS profile `d` (from AWS_PROFILE) is in neither ~/.aws/credentials nor \
             ~/.aws/config; run `aws configure --profile d` or unset AWS_PROFILE"
        );
        let e = h.run(&[("AWS_DEFAULT_PROFILE", "x")], true).unwrap_err();
        assert!(e.contains("`x` (from AWS_DEFAULT_PROFILE)"), "{e}");
    }

    #[test]
    fn file_locations_from_environment() {
        let h = home("", "");
        std::fs::write(
            h.0.join("c"),
            "[p]\naws_access_key_id=K\naws_secret_access_key=S\n",
        )
        .unwrap();
        std::fs::write(h.0.join("f"), "[profile p]\nregion = far\n").unwrap();
        let f = h.0.join("f").display().to_string();
        let c = h.ok(&[
            ("AWS_SHARED_CREDENTIALS_FILE", "~/c"),
            ("AWS_CONFIG_FILE", &f),
            ("AWS_PROFILE", "p"),
        ]);
        assert_eq!((keys(&c).0, c.region.as_str()), ("K", "far"));
    }

    #[test]
    fn no_credentials_anywhere_or_no_sign_request() {
        let h = home("", "[default]\nregion = r\n");
        let c = h.ok(&[]);
        let (cr, cf) = (h.file("credentials"), h.file("config"));
        let looked = format!("none found (looked in: environment, {cr}, {cf})");
        assert_eq!((c.credentials, c.credentials_from), (None, looked));
        let h = home(CREDS, "[default]\nendpoint_url = http://e\nregion = r\n");
        let c = h.run(&ENV, true).unwrap();
        assert_eq!(
            (c.credentials, c.credentials_from.as_str()),
            (None, "none (--no-sign-request)")
        );
        assert_eq!(
            (c.endpoint.as_deref(), c.region.as_str()),
            (Some("http://e"), "r")
        );
    }

    #[test]
    fn debug_hides_secrets() {
        let (access_key, secret_key, token) =
            ("AKIDSHOWN".into(), "SECRET1".into(), "SECRET2".into());
        let keys = Credentials {
            access_key,
            secret_key,
            session_token: Some(token),
        };
        let shown = format!(
            "{:?}",
            S3Config {
                credentials: Some(keys),
                ..home("", "").ok(&[])
            }
        );
        assert!(
            shown.contains("AKIDSHOWN") && shown.contains("secret: <redacted>"),
            "{shown}"
        );
        assert!(
            !shown.contains("SECRET1") && !shown.contains("SECRET2"),
            "{shown}"
        );
    }

    #[test]
    fn ini_dialect() {
        let creds =
            "\u{feff}# comment\r\n; another\r\n[default]\r\n  AWS_ACCESS_KEY_ID   =   K1  \r\n\
                     \r\naws_secret_access_key:S1\r\n";
        let conf = "[default]\nendpoint_url = http://h:9000/ ; no inline comments\n";
        let e = home(creds, conf).err(&[]);
        assert!(
            e.contains("`http://h:9000/…` (from profile default in "),
            "{e}"
        );
        // `:` delimits too; [DEFAULT]'s keys go into every section (configparser).
        let conf = "[DEFAULT]\nregion = dflt\n[default]\n\tendpoint_url\t:\thttp://h:9000/\n";
        let c = home(creds, conf).ok(&[]);
        assert_eq!((keys(&c), c.region.as_str()), (("K1", "S1", None), "dflt"));
        assert_eq!(c.endpoint.as_deref(), Some("http://h:9000"));
    }

    #[test]
    fn malformed_files_name_file_and_line() {
        let cases = [
            (
                "[default]\naws_access_key_id = K\nSECRETWITHOUTEQUALS\n",
                3,
                "not `key = value`",
            ),
            ("aws_access_key_id = K\n", 1, "before the first [section]"),
            ("[a]\nx = 1\n[b]\n[a]\n", 4, "[a] appears twice"),
            ("[a]\nx = 1\nX = 2\n", 3, "`x` is empty or twice"),
            ("[a]\ns3 =\n  addressing_style path\n", 3, "`s3 =` block"),
        ];
        for (text, line, what) in cases {
            let h = home(text, "");
            let e = h.err(&[]);
            assert!(
                e.starts_with(&format!("{} line {line}: ", h.file("credentials"))),
                "{e}"
            );
            assert!(
                e.contains(what) && !e.contains("SECRETWITHOUTEQUALS"),
                "{e}"
            );
        }
    }

    #[test]
    fn path_style_and_addressing_style() {
        let custom = [("AWS_ENDPOINT_URL", "https://lumidata.eu")];
        let style = |s| {
            home(
                "",
                &format!("[default]\ns3 =\n\n    addressing_style = {s}\n    x = y\n"),
            )
        };
        let homes = [home("", ""), style("virtual"), style("path"), style("auto")];
        let got = homes.map(|h| (h.ok(&custom).path_style, h.ok(&[]).path_style));
        assert_eq!(
            got,
            [(true, false), (false, false), (true, true), (true, false)]
        );
    }

    #[test]
    fn bad_endpoint_and_unsupported_providers() {
        let e = home("", "").err(&[("AWS_ENDPOINT_URL", "lumidata.eu")]);
        assert!(e.contains("`lumidata.eu` (from AWS_ENDPOINT_URL)"), "{e}");
        let h = home(
            CREDS,
            "[default]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = x\n",
        );
        assert!(h.err(&[]).contains("`role_arn`") && h.run(&[], true).is_ok());
    }
}
