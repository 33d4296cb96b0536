//! What the lake on object storage (docs/src/contributors/object-storage.md) asks of an
//! S3 store, checked through object_store's S3 client (the one
//! DataFusion reads with) against the tests' S3 server, s3s-fs: objects and listings, multipart
//! uploads, range reads and copies, and the conditional writes that publication and the
//! one-roller and one-publisher leases stand on.

mod support;

use std::sync::Arc;

use futures::TryStreamExt as _;
use object_store::path::Path;
use object_store::{
    Error, ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload, UpdateVersion,
    WriteMultipart,
};
use support::s3::S3Server;

fn create_only() -> PutOptions {
    PutMode::Create.into()
}

fn if_match(e_tag: &Option<String>) -> PutOptions {
    PutMode::Update(UpdateVersion {
        e_tag: e_tag.clone(),
        version: None,
    })
    .into()
}

async fn read(store: &dyn ObjectStore, key: &Path) -> Vec<u8> {
    store
        .get(key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_listings_ranges_copies_and_multipart_uploads() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let store = server.store();

    // Objects under "directories", as the lake lays out its partitions.
    let keys = [
        "samples/date=2026-01-01/hour=00/part-0.parquet",
        "samples/date=2026-01-01/hour=00/part-1.parquet",
        "samples/date=2026-01-01/hour=01/part-0.parquet",
        "rollups/gpu_hour/date=2026-01-01/part-0.parquet",
    ];
    for (i, key) in keys.iter().enumerate() {
        store
            .put(&Path::from(*key), PutPayload::from(format!("object {i}")))
            .await
            .unwrap();
    }
    assert_eq!(
        read(&*store, &Path::from(keys[1])).await,
        b"object 1",
        "GET returns what PUT stored"
    );
    // The server keeps objects as files: a test can see where each landed.
    assert!(server.object_path(keys[3]).is_file());

    // A recursive listing under a prefix, and one level of it with the delimiter.
    let mut under: Vec<String> = store
        .list(Some(&Path::from("samples/date=2026-01-01")))
        .map_ok(|meta| meta.location.to_string())
        .try_collect()
        .await
        .unwrap();
    under.sort();
    assert_eq!(under, keys[..3]);
    let level = store
        .list_with_delimiter(Some(&Path::from("samples/date=2026-01-01")))
        .await
        .unwrap();
    let mut prefixes: Vec<String> = level
        .common_prefixes
        .iter()
        .map(|p| p.to_string())
        .collect();
    prefixes.sort();
    assert_eq!(
        prefixes,
        [
            "samples/date=2026-01-01/hour=00",
            "samples/date=2026-01-01/hour=01"
        ]
    );
    assert!(level.objects.is_empty(), "{:?}", level.objects);
    let top = store.list_with_delimiter(None).await.unwrap();
    let mut top: Vec<String> = top.common_prefixes.iter().map(|p| p.to_string()).collect();
    top.sort();
    assert_eq!(top, ["rollups", "samples"]);

    // A multipart upload of three parts (S3's smallest part but the last is 5 MiB), read back
    // whole and by ranges, as Parquet readers read a footer and then column chunks.
    let big = Path::from("samples/date=2026-01-01/hour=02/part-0.parquet");
    let body: Vec<u8> = (0..11 * 1024 * 1024 + 17)
        .map(|i: usize| (i * 31 % 251) as u8)
        .collect();
    let mut upload = WriteMultipart::new_with_chunk_size(
        store.put_multipart(&big).await.unwrap(),
        5 * 1024 * 1024,
    );
    for chunk in body.chunks(1024 * 1024 - 3) {
        upload.write(chunk);
    }
    upload.finish().await.unwrap();
    assert_eq!(store.head(&big).await.unwrap().size, body.len() as u64);
    assert!(read(&*store, &big).await == body, "the multipart object");
    let tail = (body.len() - 8) as u64..body.len() as u64;
    assert_eq!(
        store.get_range(&big, tail.clone()).await.unwrap(),
        body[tail.start as usize..]
    );
    let ranges = [5_000_000..5_300_000u64, 10_485_000..10_486_000];
    let parts = store.get_ranges(&big, &ranges).await.unwrap();
    for (range, part) in ranges.iter().zip(&parts) {
        assert_eq!(part, &body[range.start as usize..range.end as usize]);
    }

    // A server-side copy, then deletes; a deleted object is gone for GET and for listings.
    let copy = Path::from("samples/date=2026-01-01/hour=02/part-copy.parquet");
    store.copy(&big, &copy).await.unwrap();
    assert!(read(&*store, &copy).await == body, "the copy");
    store.delete(&big).await.unwrap();
    store.delete(&copy).await.unwrap();
    assert!(matches!(store.get(&big).await, Err(Error::NotFound { .. })));
    let left: Vec<_> = store
        .list(Some(&Path::from("samples/date=2026-01-01/hour=02")))
        .try_collect()
        .await
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
}

/// The two conditional writes the design uses, one writer after another as a lease takeover or
/// a publication meets them: a create-only PUT (`If-None-Match: *`) wins once per key, and a
/// compare-and-swap PUT (`If-Match: <etag>`) wins only against the version it read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_only_put_wins_once_and_a_stale_if_match_loses() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let store = server.store();
    let lock = Path::from("_locks/roller");

    // Two pipelines both saw no lock and both try to take it: the first PUT creates it, the
    // second is refused and leaves the first one's object untouched.
    let first = store
        .put_opts(&lock, PutPayload::from("holder=a epoch=1"), create_only())
        .await
        .expect("the first create-only PUT");
    let second = store
        .put_opts(&lock, PutPayload::from("holder=b epoch=1"), create_only())
        .await;
    assert!(
        matches!(second, Err(Error::AlreadyExists { .. })),
        "a create-only PUT over an existing object: {second:?}"
    );
    assert_eq!(read(&*store, &lock).await, b"holder=a epoch=1");
    assert!(first.e_tag.is_some(), "S3 gives an ETag for every PUT");

    // Both read the lock at the same version; `a` renews it first, so `b`'s takeover, which
    // names the version it read, loses.
    let seen = store.head(&lock).await.unwrap().e_tag;
    assert_eq!(seen, first.e_tag, "HEAD gives the ETag that the PUT gave");
    let renewed = store
        .put_opts(&lock, PutPayload::from("holder=a epoch=2"), if_match(&seen))
        .await
        .expect("a PUT with the current ETag");
    assert_ne!(renewed.e_tag, seen, "a new body has a new ETag");
    let takeover = store
        .put_opts(&lock, PutPayload::from("holder=b epoch=2"), if_match(&seen))
        .await;
    assert!(
        matches!(takeover, Err(Error::Precondition { .. })),
        "a PUT with a stale ETag: {takeover:?}"
    );
    assert_eq!(read(&*store, &lock).await, b"holder=a epoch=2");

    // After `a` releases the lock (a delete), `b`'s create-only PUT takes it.
    store.delete(&lock).await.unwrap();
    store
        .put_opts(&lock, PutPayload::from("holder=b epoch=3"), create_only())
        .await
        .expect("a create-only PUT once the object is gone");
    assert_eq!(read(&*store, &lock).await, b"holder=b epoch=3");
    let missing = store
        .put_opts(
            &Path::from("_locks/none"),
            PutPayload::from("x"),
            if_match(&seen),
        )
        .await;
    assert!(
        matches!(missing, Err(Error::Precondition { .. })),
        "If-Match on a missing object: {missing:?}"
    );
}

/// Writers racing, truly concurrently, to create one object: exactly one may win each round,
/// and the object holds the winner's body. A store whose conditional writes are checked apart
/// from the write lets several win.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_create_only_puts_have_exactly_one_winner() {
    const WRITERS: usize = 8;
    const ROUNDS: usize = 50;
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"), "lake");
    let store = server.store();
    let mut several = Vec::new();
    for round in 0..ROUNDS {
        let key = Path::from(format!("_locks/round-{round}"));
        let tries = (0..WRITERS).map(|writer| {
            let (store, key) = (Arc::clone(&store), key.clone());
            tokio::spawn(async move {
                let body = format!("writer {writer}");
                let result = store
                    .put_opts(&key, PutPayload::from(body.clone()), create_only())
                    .await;
                (body, result)
            })
        });
        let mut winners = Vec::new();
        for task in futures::future::join_all(tries).await {
            let (body, result) = task.unwrap();
            match result {
                Ok(_) => winners.push(body),
                Err(Error::AlreadyExists { .. }) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        assert!(!winners.is_empty(), "round {round}: nobody won");
        let stored = String::from_utf8(read(&*store, &key).await).unwrap();
        if winners.len() > 1 {
            several.push(format!(
                "round {round}: {winners:?} all won; {stored:?} stayed"
            ));
        } else {
            assert_eq!(stored, winners[0], "round {round}");
        }
    }
    assert!(
        several.is_empty(),
        "create-only PUTs with more than one winner, in {} of {ROUNDS} rounds:\n{}",
        several.len(),
        several.join("\n")
    );
}
