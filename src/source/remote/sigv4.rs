//! AWS Signature Version 4 for the few requests archfs sends (ranged GETs, a listing,
//! the PUT of an index): the few dozen lines of it, rather than an SDK and its async
//! runtime.

use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use super::config::Credentials;

/// What of a request is signed.
pub struct Request<'a> {
    pub method: &'a str,
    /// `host[:port]`.
    pub host: &'a str,
    /// The path, already percent-encoded.
    pub uri: &'a str,
    /// The query, percent-encoded, parameters sorted by name.
    pub query: &'a str,
    /// Further headers to sign, lower-case names.
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
}

/// The headers to add to `req` so that S3 accepts it: `x-amz-date`,
/// `x-amz-content-sha256`, the session token if any, and `authorization`.
pub fn sign(
    creds: &Credentials,
    region: &str,
    req: &Request<'_>,
    now: SystemTime,
) -> Vec<(&'static str, String)> {
    let (date, stamp) = amz_date(now);
    let payload = hex(&Sha256::digest(req.body));
    let mut headers: Vec<(&str, String)> = vec![("host", req.host.to_owned())];
    headers.extend(req.headers.iter().map(|(k, v)| (*k, v.trim().to_owned())));
    headers.push(("x-amz-content-sha256", payload.clone()));
    headers.push(("x-amz-date", stamp.clone()));
    if let Some(token) = &creds.session_token {
        headers.push(("x-amz-security-token", token.clone()));
    }
    headers.sort_by(|a, b| a.0.cmp(b.0));
    let signed: Vec<&str> = headers.iter().map(|h| h.0).collect();
    let signed = signed.join(";");
    let mut canonical = format!("{}\n{}\n{}\n", req.method, req.uri, req.query);
    for (k, v) in &headers {
        canonical.push_str(&format!("{k}:{v}\n"));
    }
    canonical.push_str(&format!("\n{signed}\n{payload}"));
    let scope = format!("{date}/{region}/s3/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{}",
        hex(&Sha256::digest(canonical.as_bytes()))
    );
    let mut key = hmac(
        format!("AWS4{}", creds.secret_key).as_bytes(),
        date.as_bytes(),
    );
    for part in [region, "s3", "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    let signature = hex(&hmac(&key, to_sign.as_bytes()));
    let mut out = vec![("x-amz-date", stamp), ("x-amz-content-sha256", payload)];
    if let Some(token) = &creds.session_token {
        out.push(("x-amz-security-token", token.clone()));
    }
    out.push((
        "authorization",
        format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
            creds.access_key
        ),
    ));
    out
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `YYYYMMDD` and `YYYYMMDDTHHMMSSZ` of `now`, in UTC.
fn amz_date(now: SystemTime) -> (String, String) {
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, m, d) = civil(secs / 86_400);
    let t = secs % 86_400;
    let date = format!("{y:04}{m:02}{d:02}");
    let stamp = format!("{date}T{:02}{:02}{:02}Z", t / 3600, t / 60 % 60, t % 60);
    (date, stamp)
}

/// Year, month, day of a day count since 1970-01-01 (Howard Hinnant's algorithm).
pub fn civil(days: u64) -> (i64, u32, u32) {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The GET Object example of AWS's SigV4 documentation for S3 ("Example: GET
    /// Object", a range of 10 bytes), to the published signature.
    #[test]
    fn aws_documented_example() {
        let creds = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
        };
        // 2013-05-24T00:00:00Z
        let now = UNIX_EPOCH + Duration::from_secs(1_369_353_600);
        let req = Request {
            method: "GET",
            host: "examplebucket.s3.amazonaws.com",
            uri: "/test.txt",
            query: "",
            headers: &[("range", "bytes=0-9")],
            body: b"",
        };
        let h = sign(&creds, "us-east-1", &req, now);
        let auth = &h.iter().find(|h| h.0 == "authorization").unwrap().1;
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    #[test]
    fn dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(19_723), (2024, 1, 1));
        assert_eq!(civil(19_782), (2024, 2, 29));
        let (d, s) = amz_date(UNIX_EPOCH + Duration::from_secs(1_764_028_800 + 3661));
        assert_eq!((d.as_str(), s.as_str()), ("20251125", "20251125T010101Z"));
    }
}
