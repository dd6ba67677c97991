//! The daemon's Varlink transport (`varlink::socket::split` and `Reader::next`): a client's
//! bytes arrive on a real Unix socket in pieces of fuzzer-chosen sizes, and the reader must
//! hand out exactly the NUL-terminated messages, in order, then report the end: `Ok(None)`
//! after a final NUL, an error for an unfinished message. Each message is then decoded as the
//! daemon does (`zlink::Call<RawCall>`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcell_proto::kernel::RawCall;
use sandcelld::varlink::socket;
use std::sync::OnceLock;
use tokio::io::AsyncWriteExt;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|input: &[u8]| {
    // First byte: how many following bytes are piece sizes (at most 7); then the stream.
    let Some((&n, rest)) = input.split_first() else {
        return;
    };
    let n = (n as usize % 8).min(rest.len());
    let (sizes, data) = rest.split_at(n);
    let mut expected: Vec<&[u8]> = data.split(|&b| b == 0).collect();
    let unfinished = !expected.pop().unwrap_or_default().is_empty();
    let sizes = sizes.to_vec();
    let data = data.to_vec();
    runtime().block_on(async move {
        let (client, server) = tokio::net::UnixStream::pair().expect("socketpair");
        let writer = tokio::spawn(async move {
            let mut client = client;
            let mut at = 0;
            let mut i = 0;
            while at < data.len() {
                let want = sizes
                    .get(i % sizes.len().max(1))
                    .map_or(data.len(), |&s| s as usize + 1);
                let end = (at + want).min(data.len());
                if client.write_all(&data[at..end]).await.is_err() {
                    return;
                }
                at = end;
                i += 1;
                tokio::task::yield_now().await;
            }
            let _ = client.shutdown().await;
        });
        let (mut reader, _writer) = socket::split(server, 0);
        let mut got = Vec::new();
        let end = loop {
            match reader.next().await {
                Ok(Some(m)) => {
                    assert!(m.fds.is_empty());
                    let _ = serde_json::from_slice::<zlink::Call<RawCall>>(&m.bytes);
                    got.push(m.bytes);
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        writer.await.unwrap();
        assert_eq!(got.len(), expected.len(), "messages handed out");
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.as_slice(), *e);
        }
        assert_eq!(end.is_err(), unfinished, "end of stream: {end:?}");
    });
});
