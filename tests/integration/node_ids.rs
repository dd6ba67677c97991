//! Node-qualified session ids, against the real daemon: `Open` and the `started` frame give
//! `<node>.<local id>`, every method accepts the qualified and the bare id, an id naming
//! another node is `WrongNode`, and `node_id = ""` gives bare ids.

use crate::common;

use common::Daemon;
use sandcell_client::{Error, KernelError};

fn split(id: &str) -> (&str, &str) {
    id.rsplit_once('.').expect("a node-qualified id")
}

fn is_local(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[tokio::test]
async fn a_configured_node_qualifies_ids_and_both_forms_work() {
    let node = "node-a.example_1";
    let d = Daemon::start(&[("SANDCELL_NODE_ID", node)]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let (n, local) = split(&s);
    assert_eq!(n, node, "{s}");
    assert!(is_local(local), "{s}");

    // Both forms name the session; the started frame gives the qualified one.
    let out = c.execute_collect(&s, "x = 41\nprint(x)").await.unwrap();
    assert_eq!(out.stdout, "41\n");
    c.execute(local, "print(x + 1)").await.unwrap();
    let started = c
        .next_frame()
        .await
        .unwrap()
        .started
        .expect("started first");
    assert_eq!(started.session, s);
    let out = c.finish(|_| {}).await.unwrap();
    assert_eq!(out.stdout, "42\n");
    c.put_bytes(&s, "a.txt", b"abc").await.unwrap();
    let (files, _) = c.list_files(local).await.unwrap();
    assert!(files.iter().any(|f| f.name == "a.txt"), "{files:?}");

    // Another node's id: WrongNode, naming both nodes.
    let other = format!("node-b.{local}");
    match c.execute_collect(&other, "print(1)").await {
        Err(Error::Kernel(KernelError::WrongNode {
            session,
            node: n,
            expected,
        })) => {
            assert_eq!(session, other);
            assert_eq!(n, "node-b");
            assert_eq!(expected, node);
        }
        other => panic!("an id of another node: {other:?}"),
    }
    match c.close(&other).await {
        Err(Error::Kernel(e @ KernelError::WrongNode { .. })) => assert!(e.is_no_such_session()),
        other => panic!("Close with an id of another node: {other:?}"),
    }
    // A one-shot run's started frame is qualified too.
    c.run("python", "print(1)", None).await.unwrap();
    let started = c
        .next_frame()
        .await
        .unwrap()
        .started
        .expect("started first");
    assert_eq!(split(&started.session).0, node);
    c.finish(|_| {}).await.unwrap();

    // Closed by its bare id; the qualified id then says it ended.
    c.close(local).await.unwrap();
    match c.execute_collect(&s, "1").await {
        Err(Error::Kernel(KernelError::SessionEnded {
            session, reason, ..
        })) => {
            assert_eq!(session, s);
            assert_eq!(reason, "closed");
        }
        other => panic!("a closed session by its qualified id: {other:?}"),
    }
}

#[tokio::test]
async fn the_default_node_is_the_app_specific_machine_id_and_empty_turns_it_off() {
    let d = Daemon::start(&[("-SANDCELL_NODE_ID", "")]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let (node, local) = split(&s);
    assert!(is_local(node) && is_local(local), "{s}");
    let machine = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    assert_ne!(
        node,
        machine.trim(),
        "the machine id itself must not be exposed"
    );
    if let Ok(out) = std::process::Command::new("systemd-id128")
        .args([
            "machine-id",
            "--app-specific=3e56bd78df0e00b009fbbb93a19bc1ad",
        ])
        .output()
        && out.status.success()
    {
        assert_eq!(node, String::from_utf8_lossy(&out.stdout).trim());
    }
    c.close(&s).await.unwrap();
    drop(d);

    let d = Daemon::start(&[("SANDCELL_NODE_ID", "")]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    assert!(is_local(&s), "node_id = \"\" gives bare ids: {s}");
    let out = c.execute_collect(&s, "print(2)").await.unwrap();
    assert_eq!(out.stdout, "2\n");
    match c.execute_collect(&format!("n1.{s}"), "1").await {
        Err(Error::Kernel(KernelError::WrongNode { expected, .. })) => assert_eq!(expected, ""),
        other => panic!("a qualified id on an unqualified daemon: {other:?}"),
    }
    c.close(&s).await.unwrap();
}
