//! The S3 test harness alone (tests/common/s3.rs), no archfs: a SeaweedFS server starts,
//! stores, serves ranges, keeps its objects over a restart and leaves no process behind;
//! and it answers like S3 where archfs's client depends on it (signatures checked, error
//! codes, preconditions, ranges), so a change of SeaweedFS that breaks those shows here.

use crate::common;

use std::time::Instant;

use common::s3::{self, S3Server, Signer};
use common::*;

const MIB: usize = 1 << 20;

/// A process of the server is gone: no such pid, or only a zombie.
fn gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
        .unwrap_or(true)
}

#[test]
fn a_server_stores_serves_ranges_survives_a_restart_and_stops_entirely() {
    let t0 = Instant::now();
    let mut s3 = S3Server::start();
    eprintln!("started in {:?} at {}", s3.startup, s3.endpoint());
    assert!(s3.endpoint().starts_with("http://127.0.0.1:"));

    let dir = TempDir::new("s3-smoke");
    let data = xorshift_bytes(7)(3 * MIB);
    let src = dir.join("data.bin");
    std::fs::write(&src, &data).unwrap();
    s3.create_bucket("smoke");
    s3.put("smoke", "dir/data.bin", &src);

    let (size, etag) = s3.head("smoke", "dir/data.bin");
    assert_eq!(size, data.len() as u64);
    // One PUT (under boto3's 8 MiB multipart threshold): the quoted MD5.
    assert!(
        etag.len() == 34 && etag.starts_with('"') && etag.ends_with('"'),
        "{etag}"
    );
    assert_eq!(
        s3.get_range("smoke", "dir/data.bin", 1000..2000),
        &data[1000..2000]
    );

    let pid = s3.pid().unwrap();
    let t = Instant::now();
    s3.restart();
    eprintln!(
        "restarted in {:?}, of which starting took {:?}",
        t.elapsed(),
        s3.startup
    );
    assert!(gone(pid), "the old weed {pid} outlived the restart");
    assert_eq!(s3.head("smoke", "dir/data.bin"), (size, etag));
    assert_eq!(
        s3.get_range("smoke", "dir/data.bin", 1000..2000),
        &data[1000..2000]
    );
    assert_eq!(s3.get("smoke", "dir/data.bin"), data);
    // Writes work at once too (a master resuming its state refused them for 15 s).
    let t = Instant::now();
    s3.put_bytes("smoke", "after-restart", b"new");
    eprintln!("a PUT after the restart took {:?}", t.elapsed());
    assert_eq!(s3.get("smoke", "after-restart"), b"new");

    s3.delete("smoke", "dir/data.bin");
    let r = s3.send("HEAD", "/smoke/dir/data.bin", &[], Signer::Server);
    assert_eq!(r.status, 404);

    let pid = s3.pid().unwrap();
    let t = Instant::now();
    s3.stop();
    eprintln!("stopped in {:?}", t.elapsed());
    assert!(gone(pid), "weed {pid} outlived stop");
    assert!(
        s3::group_members(pid).is_empty(),
        "processes of weed's group outlived stop: {:?}",
        s3::group_members(pid)
    );
    assert_eq!(s3.pid(), None);
    eprintln!("the whole test took {:?}", t0.elapsed());
}

#[test]
fn dropping_a_server_kills_it() {
    let s3 = S3Server::start();
    let pid = s3.pid().unwrap();
    drop(s3);
    assert!(gone(pid) && s3::group_members(pid).is_empty());
}

/// What archfs's S3 client meets: each answer here is listed in tests/common/s3.rs.
#[test]
fn the_server_checks_signatures_and_answers_like_s3() {
    let s3 = S3Server::start();
    s3.create_bucket("answers");
    let data = xorshift_bytes(11)(100_000);
    s3.put_bytes("answers", "obj", &data);
    let (_, etag) = s3.head("answers", "obj");
    let get = |headers: &[(&str, &str)], signer| s3.send("GET", "/answers/obj", headers, signer);
    let code = |r: &s3::Reply| (r.status, r.error_code().unwrap_or_default());

    let ok = get(&[], Signer::Server);
    assert_eq!(ok.status, 200);
    assert_eq!(ok.body, data);

    // Signatures are checked.
    let wrong_secret = Signer::As {
        access_key: s3::ACCESS_KEY,
        secret_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYWRONGWRONG",
    };
    let r = get(&[], wrong_secret);
    assert_eq!(code(&r), (403, "SignatureDoesNotMatch".into()), "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/xml"), "{r:?}");
    let r = s3.send("HEAD", "/answers/obj", &[], wrong_secret);
    assert_eq!((r.status, r.body.len()), (403, 0), "{r:?}");
    let unknown = Signer::As {
        access_key: "AKIAARCHFSNOBODY0001",
        secret_key: s3::SECRET_KEY,
    };
    assert_eq!(code(&get(&[], unknown)), (403, "InvalidAccessKeyId".into()));
    let r = s3.send(
        "GET",
        "/answers/obj",
        &[("X-Amz-Content-SHA256", "UNSIGNED-PAYLOAD")],
        Signer::Server,
    );
    assert_eq!(r.status, 200, "UNSIGNED-PAYLOAD: {r:?}");

    // Missing things.
    let r = s3.send("GET", "/no-such-bucket/obj", &[], Signer::Server);
    assert_eq!(code(&r), (404, "NoSuchBucket".into()), "{r:?}");
    let r = s3.send("GET", "/answers/no-such-key", &[], Signer::Server);
    assert_eq!(code(&r), (404, "NoSuchKey".into()), "{r:?}");
    for path in ["/no-such-bucket/obj", "/answers/no-such-key"] {
        let r = s3.send("HEAD", path, &[], Signer::Server);
        assert_eq!((r.status, r.body.len()), (404, 0), "HEAD {path}: {r:?}");
    }

    // HEAD of an object.
    let r = s3.send("HEAD", "/answers/obj", &[], Signer::Server);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("etag"), Some(etag.as_str()));
    assert_eq!(r.header("content-length"), Some("100000"));
    assert!(r.header("last-modified").is_some(), "{r:?}");

    // Ranges.
    let r = get(&[("Range", "bytes=1000-1999")], Signer::Server);
    assert_eq!(r.status, 206);
    assert_eq!(r.header("content-range"), Some("bytes 1000-1999/100000"));
    assert_eq!(r.header("content-length"), Some("1000"));
    assert_eq!(r.body, &data[1000..2000]);
    let r = get(&[("Range", "bytes=99990-200000")], Signer::Server);
    assert_eq!(r.status, 206, "{r:?}");
    assert_eq!(r.header("content-range"), Some("bytes 99990-99999/100000"));
    assert_eq!(r.body, &data[99990..]);
    let r = get(&[("Range", "bytes=200000-200010")], Signer::Server);
    assert_eq!(code(&r), (416, "InvalidRange".into()), "{r:?}");

    // Preconditions.
    let r = get(&[("If-Match", "\"0123456789abcdef\"")], Signer::Server);
    assert_eq!(code(&r), (412, "PreconditionFailed".into()), "{r:?}");
    let r = get(
        &[("If-Match", "\"0123456789abcdef\""), ("Range", "bytes=0-9")],
        Signer::Server,
    );
    assert_eq!(code(&r), (412, "PreconditionFailed".into()), "{r:?}");
    let r = get(
        &[("If-Match", etag.as_str()), ("Range", "bytes=0-9")],
        Signer::Server,
    );
    assert_eq!((r.status, &r.body[..]), (206, &data[..10]));
    let r = get(&[("If-None-Match", etag.as_str())], Signer::Server);
    assert_eq!(r.status, 304, "{r:?}");

    // A multipart upload: the ETag counts the parts.
    let dir = TempDir::new("s3-answers");
    let big = dir.join("big");
    std::fs::write(&big, xorshift_bytes(12)(9 * MIB)).unwrap();
    s3.put("answers", "big", &big);
    let (size, etag) = s3.head("answers", "big");
    assert_eq!(size, 9 * MIB as u64);
    assert!(etag.ends_with("-2\""), "{etag}");

    // The read-only identity reads and may not write; anonymous reads the public bucket
    // only.
    let reader = Signer::As {
        access_key: s3::READER_ACCESS_KEY,
        secret_key: s3::READER_SECRET_KEY,
    };
    assert_eq!(get(&[], reader).status, 200);
    let r = s3.send("PUT", "/answers/by-reader", &[], reader);
    assert_eq!(code(&r), (403, "AccessDenied".into()), "{r:?}");
    let r = get(&[], Signer::Anonymous);
    assert_eq!(code(&r), (403, "AccessDenied".into()), "{r:?}");
    s3.create_bucket(s3::PUBLIC_BUCKET);
    s3.put_bytes(s3::PUBLIC_BUCKET, "open", b"to all");
    let r = s3.send("GET", "/public/open", &[], Signer::Anonymous);
    assert_eq!((r.status, &r.body[..]), (200, &b"to all"[..]), "{r:?}");
    let r = s3.send("PUT", "/public/by-anyone", &[], Signer::Anonymous);
    assert_eq!(code(&r), (403, "AccessDenied".into()), "{r:?}");
}

#[test]
fn a_child_gets_the_servers_credentials_and_none_of_the_machines() {
    let s3 = S3Server::start();
    let mut cmd = std::process::Command::new("env");
    cmd.env("AWS_PROFILE", "someone-elses")
        .env("AWS_SESSION_TOKEN", "stale");
    let env = String::from_utf8(run_ok(s3.apply_env(&mut cmd)).stdout).unwrap();
    let aws: Vec<&str> = env.lines().filter(|l| l.starts_with("AWS_")).collect();
    for (k, v) in s3.env() {
        assert!(aws.contains(&format!("{k}={v}").as_str()), "{k}: {aws:?}");
    }
    assert_eq!(aws.len(), s3.env().len(), "{aws:?}");
    let config = s3.env().into_iter().find(|(k, _)| k == "AWS_CONFIG_FILE");
    assert!(!std::path::Path::new(&config.unwrap().1).exists());
}
