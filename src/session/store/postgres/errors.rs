//! PostgreSQL errors as the store reports them: the server's own message (never a value it
//! quotes from a refused row), a driver error with its causes, and whether the connection is
//! broken (retried on another) or the call failed.

use std::time::Duration;

use super::super::attempt::Attempt;
use super::err;

/// A driver error as an [`Attempt`]'s failure: broken when the connection was closed.
pub(super) fn classify(e: tokio_postgres::Error) -> Attempt {
    match e.is_closed() {
        true => Attempt::Broken(err("connection closed")),
        false => Attempt::Failed(err(describe(&e))),
    }
}

/// `fut` within `timeout`, its error classified ([`classify`]).
pub(super) async fn bounded<T>(
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, Attempt> {
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(Attempt::Failed(err(format!(
            "no answer within {} ms",
            timeout.as_millis()
        )))),
        Ok(result) => result.map_err(classify),
    }
}

/// The server's message for a database error (`relation ... does not exist`, `permission
/// denied ...`), else the driver's with its causes: `tokio_postgres::Error`'s own text is only
/// "db error" or "error performing TLS handshake".
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        // A data exception (class 22) quotes the value it refused after a colon (`invalid
        // input syntax for type uuid: "..."`): with a `session.query`, a sid.
        Some(db) if db.code().code().starts_with("22") => {
            let message = db.message();
            let said = message.split_once(": ").map_or(message, |(said, _)| said);
            format!("{said} ({})", db.code().code())
        }
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => causes(e),
    }
}

/// `e` and each error it was caused by, joined with ": " (a refused certificate says why).
pub(super) fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        next = cause.source();
    }
    text
}
