//! Python cells and the session directory: uploads are visible at /mnt/data,
//! files a cell writes come back, and the session's disk budget is enforced after each cell.

use crate::common;

use common::Daemon;
use sandcell_client::Status;

#[tokio::test]
async fn csv_in_summary_out() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    c.put_bytes(&s, "input.csv", b"city,temp\nOslo,-3\nLima,19\nCairo,24\n")
        .await
        .unwrap();
    let code = "import csv\nrows = list(csv.DictReader(open('/mnt/data/input.csv')))\n\
                temps = [int(r['temp']) for r in rows]\n\
                open('summary.csv', 'w').write(f'n,mean\\n{len(temps)},{sum(temps)/len(temps)}\\n')\n\
                print(len(rows))";
    let out = c.execute_collect(&s, code).await.unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    assert_eq!(out.stdout, "3\n");
    assert!(
        out.result.files.iter().any(|f| f.name == "summary.csv"),
        "{:?}",
        out.result.files
    );
    let mut data = Vec::new();
    c.get_file(&s, "summary.csv", &mut data).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&data),
        "n,mean\n3,13.333333333333334\n"
    );
}

/// The session's file system holds the budget: the write past it fails in the cell (Eryx
/// reports the host's `ENOSPC` as an I/O error), the directory never holds more, and the
/// session lives on.
#[tokio::test]
async fn a_cell_filling_the_disk_budget_meets_the_kernel_bound() {
    let d = Daemon::start(&[
        ("SANDCELL_MAX_SESSION_FILES_BYTES", "1048576"),
        ("SANDCELL_MAX_FILE_BYTES", "1048576"),
    ]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    let out = c
        .execute_collect(
            &s,
            "for i in range(3):\n    open(f'big{i}', 'wb').write(b'x' * 700000)\n",
        )
        .await
        .unwrap();
    assert_eq!(out.result.status, Status::Error, "{:?}", out.result);
    assert!(!out.result.session_ended, "{:?}", out.result);
    let held: u64 = std::fs::read_dir(d.dir.path().join("state/sessions").join(&s))
        .unwrap()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum();
    assert!(held <= 1048576, "{held} bytes held");
    let out = c.execute_collect(&s, "print(1)").await.unwrap();
    assert_eq!(out.stdout, "1\n", "{:?}", out.result);
}

#[tokio::test]
async fn a_png_written_by_a_python_cell_comes_back() {
    let d = Daemon::start(&[]);
    let mut c = d.client().await;
    let s = c.open("python", None, None).await.unwrap().session;
    // A PNG from the standard library alone (struct + zlib): what Eryx's CPython can produce.
    let code = "import struct, zlib\nw = h = 8\n\
                rows = b''.join(b'\\x00' + b''.join(bytes([x * 32, y * 32, 128]) for x in range(w)) for y in range(h))\n\
                def chunk(t, d):\n    return struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t + d))\n\
                png = b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 8, 2, 0, 0, 0)) \
                + chunk(b'IDAT', zlib.compress(rows)) + chunk(b'IEND', b'')\n\
                open('plot.png', 'wb').write(png)\n";
    let out = c.execute_collect(&s, code).await.unwrap();
    assert_eq!(out.result.status, Status::Ok, "{:?}", out.result);
    let f = out
        .result
        .files
        .iter()
        .find(|f| f.name == "plot.png")
        .expect("plot.png listed");
    assert_eq!(f.media_type, "image/png");
    let mut data = Vec::new();
    c.get_file(&s, "plot.png", &mut data).await.unwrap();
    assert_eq!(&data[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(data.len() as u64, f.size);
}
