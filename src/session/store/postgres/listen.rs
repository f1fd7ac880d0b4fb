//! The invalidation stream of the PostgreSQL store: `LISTEN tessera_kv` (or the application's
//! `session.notify_channel`) on a connection of its own, outside the pool. Notifications
//! arrive in commit order and only for committed changes; a lost listener (server restart, `pg_terminate_backend`, a stopped server that misses the
//! heartbeat) reports `Lost`, and the next `Live` makes the session layer flush its cache and
//! read again every session with open responses: stronger than replaying the change log, whose
//! ids are not in commit order.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

use super::super::{purge_every, AbortOnDrop, Invalidation};
use super::tls::Tls;
use super::{bounded, causes, err, PostgresStore, StoreError, ALL_CHANGED, CHANNEL};

/// How often the listener's connection is asked `SELECT 1`; with the store timeout, a stopped
/// server is noticed within this plus the timeout.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How often expired rows and old change-log rows are deleted.
const PURGE_EVERY: Duration = Duration::from_secs(60);
/// `application_name` of the listener's connection.
pub const LISTENER_NAME: &str = "tessera listener";
/// Keys handed on in one `Invalidation::Keys` at most, when notifications queue up.
const BATCH: usize = 1024;

impl PostgresStore {
    /// The listening loop: (re)connect, `LISTEN`, forward changed keys under `prefix`; on any
    /// failure report `Lost` and retry with backoff (100 ms doubling to 2 s).
    pub(in crate::session::store) async fn watch(
        self: Arc<Self>,
        prefix: String,
        tx: mpsc::Sender<Invalidation>,
    ) {
        let mut backoff = Duration::from_millis(100);
        if self.own.as_ref().is_some_and(|own| own.channel.is_none()) {
            // Nothing to listen on: the stream never goes live, so the cache stays off and
            // every request reads the application's table.
            tx.closed().await;
            return;
        }
        // The application's own table is not tessera's to purge.
        let purger = match self.own {
            Some(_) => None,
            None => Some(AbortOnDrop(tokio::spawn(purge_every(
                Arc::downgrade(&self),
                PURGE_EVERY,
                "postgres expired rows",
                |store: Arc<Self>| async move { store.purge().await },
            )))),
        };
        loop {
            let result = self.listen(&prefix, &tx, &mut backoff).await;
            if tx.is_closed() {
                break;
            }
            if let Err(e) = result {
                self.outage.lost("postgres", &e);
            }
            if tx.send(Invalidation::Lost).await.is_err() {
                break;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
        drop(purger);
    }

    async fn listen(
        &self,
        prefix: &str,
        tx: &mpsc::Sender<Invalidation>,
        backoff: &mut Duration,
    ) -> Result<(), StoreError> {
        // The schema first: LISTEN works without it, but the trigger that rings is part of it
        // (with the application's own table there is none to make).
        drop(self.conn().await?);
        // Named so that an operator can find it in pg_stat_activity.
        let mut config = self.config.clone();
        config.application_name(LISTENER_NAME);
        let (notes, mut notified) = mpsc::unbounded_channel();
        let connect = async {
            Ok::<_, tokio_postgres::Error>(match &self.tls {
                Tls::Off => {
                    let (client, connection) = config.connect(NoTls).await?;
                    (client, drive(connection, notes))
                }
                Tls::On(connector) => {
                    let (client, connection) = config.connect(connector.clone()).await?;
                    (client, drive(connection, notes))
                }
            })
        };
        let (client, _driver) = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| err("connect timed out"))?
            .map_err(|e| err(causes(&e)))?;
        let channel = match &self.own {
            Some(own) => own.channel.as_deref().unwrap_or(CHANNEL),
            None => CHANNEL,
        };
        bounded(
            self.timeout,
            // Quoted: a valid identifier can still be a keyword (`user`); config checked that
            // it is lower-case, so the quoted name is the one `pg_notify` rings.
            client.batch_execute(&format!("LISTEN \"{channel}\"")),
        )
        .await?;
        if tx.send(Invalidation::Live).await.is_err() {
            return Ok(());
        }
        self.outage.back("postgres");
        *backoff = Duration::from_millis(100);
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        loop {
            tokio::select! {
                note = notified.recv() => {
                    let first = note.ok_or_else(|| err("listener ended"))?.map_err(err)?;
                    let said = match drain(first, &mut notified, prefix)? {
                        Changed::Keys(keys) if keys.is_empty() => vec![],
                        Changed::Keys(keys) => vec![Invalidation::Keys(keys)],
                        // As after a lost listener: the cache flushed, every open stream's
                        // session read again.
                        Changed::All => vec![Invalidation::Lost, Invalidation::Live],
                    };
                    for invalidation in said {
                        if tx.send(invalidation).await.is_err() {
                            return Ok(());
                        }
                    }
                }
                _ = heartbeat.tick() => {
                    if tx.is_closed() {
                        return Ok(());
                    }
                    bounded(self.timeout, client.simple_query("SELECT 1")).await?;
                }
            }
        }
    }
}

/// Polls `connection` in a task of its own (which runs the client's queries) and hands each
/// notification's payload to `notes`, then the error that ended it; stopped when dropped.
fn drive<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    notes: mpsc::UnboundedSender<Result<String, String>>,
) -> AbortOnDrop
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    AbortOnDrop(tokio::spawn(async move {
        loop {
            let message = std::future::poll_fn(|cx| connection.poll_message(cx)).await;
            let next = match message {
                Some(Ok(AsyncMessage::Notification(n))) => Ok(n.payload().to_owned()),
                Some(Ok(_)) => continue,
                Some(Err(e)) => Err(e.to_string()),
                None => Err("connection closed".to_owned()),
            };
            let end = next.is_err();
            if notes.send(next).is_err() || end {
                return;
            }
        }
    }))
}

/// What queued notifications say.
enum Changed {
    /// These keys changed.
    Keys(Vec<String>),
    /// Every key did ([`ALL_CHANGED`]: `TRUNCATE tessera_kv`, which fires no row trigger).
    All,
}

/// `first` and whatever else is already queued (at most [`BATCH`] keys), those under `prefix`.
/// Errors: the listener's connection failed while they queued.
fn drain(
    first: String,
    notified: &mut mpsc::UnboundedReceiver<Result<String, String>>,
    prefix: &str,
) -> Result<Changed, StoreError> {
    let mut keys = vec![first];
    while keys.len() < BATCH {
        match notified.try_recv() {
            Ok(next) => keys.push(next.map_err(err)?),
            Err(_) => break,
        }
    }
    if keys.iter().any(|k| k == ALL_CHANGED) {
        return Ok(Changed::All);
    }
    keys.retain(|k| k.starts_with(prefix));
    Ok(Changed::Keys(keys))
}
