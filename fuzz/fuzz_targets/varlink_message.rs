//! The daemon's Varlink message decoder: a client's byte stream cut at each NUL (the Varlink
//! message terminator, as the daemon's transport does), each message decoded as the daemon
//! decodes it (`serde_json::from_slice::<zlink::Call<RawCall>>`: method, `more`, `oneway`,
//! `upgrade`, parameters), then the call's parameters parsed into the method's type exactly as
//! `varlink/kernel.rs` does (absent parameters are `{}`; the offending field is named from
//! serde's message). Nothing may panic; a decoded call re-encodes to a call that decodes to
//! the same method and parameters.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcell_proto::kernel::{self as k, RawCall};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// `varlink/kernel.rs`'s `params`: the call's parameters (absent = `{}`) as `T`, or the name
/// of the offending parameter.
fn params<T: DeserializeOwned>(call: &zlink::Call<RawCall>) -> Result<T, String> {
    serde_json::from_str(call.method().parameters_text()).map_err(|e| {
        let msg = e.to_string();
        msg.split('`').nth(1).unwrap_or("parameters").to_owned()
    })
}

/// A call's parameters as a JSON value (the daemon keeps them as text), or `Err` when the
/// text is JSON that a `Value` cannot hold (a number out of `f64`'s range: the daemon's typed
/// decode refuses it per field instead).
fn as_value(call: &RawCall) -> Result<Option<Value>, serde_json::Error> {
    call.parameters
        .as_deref()
        .map(|r| serde_json::from_str(r.get()))
        .transpose()
}

fn dispatch(call: &zlink::Call<RawCall>) {
    let method = call.method().method.clone();
    let (iface, name) = method.rsplit_once('.').unwrap_or(("", method.as_str()));
    if iface != k::INTERFACE {
        return;
    }
    let _ = match name {
        "Run" => params::<k::RunParams>(call).map(|_| ()),
        "Execute" => params::<k::ExecuteParams>(call).map(|_| ()),
        "Submit" => params::<k::SubmitParams>(call).map(|_| ()),
        "Attach" | "CellStatus" => params::<k::CellParams>(call).map(|_| ()),
        "Open" => params::<k::OpenParams>(call).map(|_| ()),
        "Interrupt" => params::<k::InterruptParams>(call).map(|_| ()),
        "Close" => params::<k::CloseParams>(call).map(|_| ()),
        "PutFile" => params::<k::PutFileParams>(call).map(|p| {
            if let Some(d) = p.data {
                let _ = k::decode_base64(&d);
            }
        }),
        "ListFiles" => params::<k::ListFilesParams>(call).map(|_| ()),
        "GetFile" => params::<k::GetFileParams>(call).map(|_| ()),
        "DeleteFile" => params::<k::DeleteFileParams>(call).map(|_| ()),
        _ => Ok(()),
    };
}

/// JSON equality, except that floats may differ in their last bit: serde_json's default float
/// parser is not exactly round-trip safe (its `float_roundtrip` feature is off), which is
/// irrelevant for parameters that are seconds or byte counts.
fn same(a: Option<&Value>, b: Option<&Value>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(Value::Number(x)), Some(Value::Number(y))) => {
            x == y
                || match (x.as_f64(), y.as_f64()) {
                    (Some(p), Some(q)) => (p - q).abs() <= p.abs().max(q.abs()) * 1e-15,
                    _ => false,
                }
        }
        (Some(Value::Array(x)), Some(Value::Array(y))) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(Some(p), Some(q)))
        }
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            x.len() == y.len() && x.iter().all(|(k, v)| same(Some(v), y.get(k)))
        }
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut messages: Vec<&[u8]> = data.split(|&b| b == 0).collect();
    messages.pop(); // after the last NUL: an unfinished message, never decoded
    for m in messages {
        let Ok(call) = serde_json::from_slice::<zlink::Call<RawCall>>(m) else {
            continue;
        };
        dispatch(&call);
        // Re-encode the envelope the way a client sends it and decode it again.
        let mut env = json!({ "method": call.method().method });
        let Ok(before) = as_value(call.method()) else {
            continue;
        };
        if let Some(p) = &before {
            env["parameters"] = p.clone();
        }
        if call.more() {
            env["more"] = Value::Bool(true);
        }
        if call.oneway() {
            env["oneway"] = Value::Bool(true);
        }
        let bytes = serde_json::to_vec(&env).expect("a decoded call re-encodes");
        let again: zlink::Call<RawCall> =
            serde_json::from_slice(&bytes).expect("a re-encoded call decodes");
        assert_eq!(again.method().method, call.method().method);
        let after = as_value(again.method()).expect("re-encoded parameters parse");
        assert!(
            same(after.as_ref(), before.as_ref()),
            "{before:?} became {after:?}"
        );
        assert_eq!((again.more(), again.oneway()), (call.more(), call.oneway()));
    }
});
