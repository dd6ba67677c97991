//! File-name validation of session directories (`files::validate_name`), the only gate
//! between a client's name and `openat2`. Checked: an accepted name is non-empty, relative,
//! at most 1024 bytes and 4 components, each component non-empty, not `.`/`..`, at most 255
//! bytes, without NUL, and the components joined with `/` give the name back. Control
//! characters and a leading `-` are accepted (a worker can create such names, and every
//! listed name must be reachable); names an upload creates (`files::validate_new_name`) are
//! a subset without them. The media-type guess must not panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcelld::files::{validate_name, validate_new_name};

fuzz_target!(|data: &[u8]| {
    let Ok(name) = std::str::from_utf8(data) else {
        return;
    };
    let _ = sandcell_proto::kernel::media_type(name);
    if let Ok(parts) = validate_new_name(name) {
        assert!(!name.chars().any(char::is_control));
        assert!(parts.iter().all(|p| !p.starts_with('-')));
        assert!(
            validate_name(name).is_ok(),
            "an upload's name is always reachable"
        );
    }
    match validate_name(name) {
        Ok(parts) => {
            assert!(!name.is_empty() && name.len() <= 1024);
            assert!(!name.starts_with('/'));
            assert!(!name.contains('\0'));
            assert!((1..=4).contains(&parts.len()));
            for p in &parts {
                assert!(!p.is_empty());
                assert!(*p != "." && *p != "..");
                assert!(p.len() <= 255);
                assert!(
                    !p.starts_with(".sandcell-put-"),
                    "the temporary-file prefix is reserved"
                );
                assert!(!p.contains('/') && !p.contains('\0'));
            }
            assert_eq!(parts.join("/"), name);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
