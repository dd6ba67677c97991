//! The node identifier in session ids (`node_id`): configured, or by default derived from
//! the machine id the way systemd derives application-specific ids
//! (`sd_id128_get_machine_app_specific(3)`), so ids do not expose `/etc/machine-id` itself.

use sha2::{Digest, Sha256};

/// sandcell's application id for the derivation (a fixed random 128-bit value, the same on
/// every machine): `systemd-id128 machine-id --app-specific=3e56bd78df0e00b009fbbb93a19bc1ad`
/// prints a machine's default node identifier.
pub const APP_ID: [u8; 16] = [
    0x3e, 0x56, 0xbd, 0x78, 0xdf, 0x0e, 0x00, 0xb0, 0x09, 0xfb, 0xbb, 0x93, 0xa1, 0x9b, 0xc1, 0xad,
];

/// The default node identifier: HMAC-SHA256 keyed with the machine id (its 16 bytes) over
/// [`APP_ID`], the first 16 bytes made a version-4 UUID, as 32 lowercase hex digits; `None`
/// when `machine_id` (the text of `/etc/machine-id`) is not 32 hex digits.
pub fn app_specific(machine_id: &str) -> Option<String> {
    let hex = machine_id.trim();
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut key = [0u8; 64];
    for (i, k) in key.iter_mut().take(16).enumerate() {
        *k = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    // HMAC (RFC 2104) with a key shorter than the block: padded with zeros.
    let inner: Vec<u8> = key.iter().map(|k| k ^ 0x36).chain(APP_ID).collect();
    let inner = Sha256::digest(inner);
    let outer: Vec<u8> = key
        .iter()
        .map(|k| k ^ 0x5c)
        .chain(inner.iter().copied())
        .collect();
    let mac = Sha256::digest(outer);
    let mut id = [0u8; 16];
    id.copy_from_slice(&mac[..16]);
    id[6] = (id[6] & 0x0f) | 0x40;
    id[8] = (id[8] & 0x3f) | 0x80;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// The node identifier in force: `configured` when set (the empty string: none, ids are not
/// qualified), else [`app_specific`] of `/etc/machine-id` (none, logged, when it cannot be
/// read).
pub fn resolve(configured: Option<&str>) -> String {
    if let Some(c) = configured {
        return c.to_owned();
    }
    match std::fs::read_to_string("/etc/machine-id")
        .ok()
        .and_then(|m| app_specific(&m))
    {
        Some(id) => id,
        None => {
            tracing::warn!(
                "node_id: /etc/machine-id is missing or malformed; session ids are not \
                 node-qualified (set node_id to qualify them)"
            );
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_systemds_app_specific_id() {
        let machine = "0123456789abcdef0123456789abcdef";
        let id = app_specific(machine).unwrap();
        assert_eq!(id.len(), 32);
        assert_ne!(id, machine);
        assert_eq!(&id[12..13], "4", "version 4");
        assert!(matches!(&id[16..17], "8" | "9" | "a" | "b"), "variant");
        assert_eq!(app_specific("short"), None);
        // The same derivation as systemd's, where its tool is installed.
        let app: String = APP_ID.iter().map(|b| format!("{b:02x}")).collect();
        if let Ok(out) = std::process::Command::new("systemd-id128")
            .args(["machine-id", &format!("--app-specific={app}")])
            .output()
            && out.status.success()
        {
            let mine = app_specific(&std::fs::read_to_string("/etc/machine-id").unwrap());
            assert_eq!(
                mine.as_deref(),
                Some(String::from_utf8_lossy(&out.stdout).trim())
            );
        }
    }
}
