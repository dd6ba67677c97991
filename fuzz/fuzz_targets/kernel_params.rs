//! Every `org.sandcell.Kernel` method's parameters, as the daemon parses them: a JSON object
//! into the method's typed struct (`deny_unknown_fields`). A value that parses must serialise
//! and parse back to itself, and the daemon's error naming (the text between the first pair of
//! backquotes of serde's message) must not panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcell_proto::kernel as k;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn close(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(x), Some(y)) => x == y || (x - y).abs() <= x.abs().max(y.abs()) * 1e-15,
        (x, y) => x == y,
    }
}

fn same_limits(a: &Option<k::Limits>, b: &Option<k::Limits>) -> bool {
    match (a, b) {
        (Some(x), Some(y)) => {
            close(x.wall_time_seconds, y.wall_time_seconds)
                && x.fuel == y.fuel
                && x.guest_memory_bytes == y.guest_memory_bytes
                && x.stdout_bytes == y.stdout_bytes
                && x.stderr_bytes == y.stderr_bytes
        }
        (x, y) => x.is_none() && y.is_none(),
    }
}

/// Parses `v` as `T` as `daemon/src/varlink/kernel.rs` does; checks the round trip with `eq`.
fn check<T: DeserializeOwned + Serialize + std::fmt::Debug>(
    v: &Value,
    eq: impl Fn(&T, &T) -> bool,
) {
    match serde_json::from_value::<T>(v.clone()) {
        Ok(p) => {
            let back = serde_json::to_value(&p).expect("parameters serialise");
            let again: T = serde_json::from_value(back).expect("serialised parameters parse");
            assert!(eq(&p, &again), "round trip changed {p:?} into {again:?}");
        }
        Err(e) => {
            let msg = e.to_string();
            let _parameter = msg.split('`').nth(1).unwrap_or("parameters").to_owned();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    check::<k::RunParams>(&v, |a, b| {
        a.language == b.language && a.code == b.code && same_limits(&a.limits, &b.limits)
    });
    check::<k::OpenParams>(&v, |a, b| {
        a.language == b.language
            && a.detached_idle_seconds == b.detached_idle_seconds
            && same_limits(&a.limits, &b.limits)
    });
    check::<k::ExecuteParams>(&v, |a, b| a == b);
    check::<k::SubmitParams>(&v, |a, b| a == b);
    check::<k::CellParams>(&v, |a, b| a == b);
    check::<k::InterruptParams>(&v, |a, b| a == b);
    check::<k::CloseParams>(&v, |a, b| a == b);
    check::<k::PutFileParams>(&v, |a, b| a == b);
    check::<k::ListFilesParams>(&v, |a, b| a == b);
    check::<k::GetFileParams>(&v, |a, b| a == b);
    check::<k::DeleteFileParams>(&v, |a, b| a == b);
    check::<k::Limits>(&v, |a, b| same_limits(&Some(a.clone()), &Some(b.clone())));
    // Inline file data and the language name are decoded by the daemon too.
    if let Some(s) = v.get("data").and_then(Value::as_str) {
        if let Ok(bytes) = k::decode_base64(s) {
            assert_eq!(k::decode_base64(&k::encode_base64(&bytes)).unwrap(), bytes);
        }
    }
    if let Some(s) = v.get("language").and_then(Value::as_str) {
        if let Some(l) = k::Language::parse(s) {
            assert_eq!(k::Language::parse(l.as_str()), Some(l));
        }
    }
    // Replies a client decodes from the daemon.
    let _ = serde_json::from_value::<k::FrameReply>(v.clone());
    if let Ok(raw) = serde_json::from_value::<k::RawError>(v) {
        let _ = raw.to_kernel_error();
    }
});
