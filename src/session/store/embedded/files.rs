//! The embedded store's directory and files: private to tessera's user (the database holds
//! every sid in clear and the sealed credentials; the lock file, readable, would let any local
//! user hold it and stall every open), and the lock that serializes opens.

use std::path::Path;

use super::{err, StoreError, OPEN_LOCK_WAIT};

/// Makes `dir` (0700, and any parent missing) and the database `file` in it (0600; SQLite gives
/// its `-wal` and `-shm` files the database file's mode) when they are missing. Existing ones
/// keep their modes; one readable by others is named in a warning.
///
/// Errors: the directory or the file cannot be made.
pub(super) fn create_private(dir: &Path, file: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| err(format!("cannot create {}: {e}", dir.display())))?;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(file)
        .map_err(|e| err(format!("cannot create {}: {e}", file.display())))?;
    for path in [dir, file] {
        let mode = std::fs::metadata(path).map_or(0, |m| m.permissions().mode());
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", mode & 0o777),
                "the session store is open to other local users (sids in clear, sealed credentials); chmod go= it"
            );
        }
    }
    Ok(())
}

/// Takes the exclusive `flock` on `path` (created if missing; opened read-only, which is all
/// `flock` needs), polling every 10 ms for at most [`OPEN_LOCK_WAIT`]; released when the
/// returned file is dropped. `flock` locks are per open file, so threads of one process exclude
/// each other too (on a local filesystem, which SQLite's WAL mode needs anyway).
///
/// Errors: the file cannot be created, opened or locked, or is still locked after the wait.
pub(super) fn lock_for_open(path: &Path) -> Result<std::fs::File, StoreError> {
    use rustix::fs::{flock, FlockOperation};
    use rustix::io::Errno;
    use std::os::unix::fs::OpenOptionsExt;
    let open = || std::fs::OpenOptions::new().read(true).open(path);
    let file = match open() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(path)
            .and_then(|_| open()),
        opened => opened,
    }
    .map_err(|e| {
        err(format!(
            "cannot open {} (the store directory must be writable by tessera): {e}",
            path.display()
        ))
    })?;
    let deadline = std::time::Instant::now() + OPEN_LOCK_WAIT;
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(file),
            Err(Errno::INTR) => {}
            Err(Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(Errno::WOULDBLOCK) => {
                return Err(err(format!(
                    "{} still locked after {} s by another tessera opening the store; \
                     retry, or look for a stuck tessera process using that directory",
                    path.display(),
                    OPEN_LOCK_WAIT.as_secs()
                )))
            }
            Err(e) => {
                return Err(err(format!(
                    "cannot lock {} (the store needs a local filesystem): {e}",
                    path.display()
                )))
            }
        }
    }
}
