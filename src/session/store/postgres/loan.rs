//! A pooled connection lent to one store call, and back into the pool only once the call ended.
//! A call the store timeout drops may be waiting on a server gone without a word (a failover by
//! DNS, a lost host, a dropped route): pooled again, its connection would fail every later call
//! the same way until the kernel gives up on it (about 15 minutes), while a new one reaches the
//! server that answers. Such a connection is closed instead. Must never: pool a connection
//! whose call was dropped, or close one whose call ended.

use std::sync::{Arc, Mutex, PoisonError};

/// A pooled connection, dropped back into the pool.
pub(super) type Conn = deadpool_postgres::Object;

/// What became of one call, shared by its [`Lent`] connection and its [`Loan`].
#[derive(Default)]
struct Ledger {
    /// The connection once its [`Lent`] was dropped and the call's end is not known yet.
    parked: Option<Conn>,
    /// The call ended ([`Loan::end`]) or was dropped ([`Loan`]'s drop) first.
    settled: Option<bool>,
}

/// The call's side of a loan: [`Loan::end`] when the call ended; dropped without it, the call
/// was, and the connection is closed.
pub(super) struct Loan(Arc<Mutex<Ledger>>);

/// The connection as the call uses it (`Deref` to the pooled client).
pub(super) struct Lent {
    conn: Option<Conn>,
    ledger: Arc<Mutex<Ledger>>,
}

/// Lends `conn` to one call.
pub(super) fn lend(conn: Conn) -> (Loan, Lent) {
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let lent = Lent {
        conn: Some(conn),
        ledger: ledger.clone(),
    };
    (Loan(ledger), lent)
}

/// Closes `conn`: out of the pool for good, its client dropped, which ends the connection.
fn close(conn: Conn) {
    drop(deadpool_postgres::Object::take(conn));
}

impl Loan {
    /// The call ended (answered or failed): its connection goes back to the pool.
    pub(super) fn end(self) {
        let mut ledger = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        ledger.settled = Some(true);
        drop(ledger.parked.take());
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        let mut ledger = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if ledger.settled.is_none() {
            ledger.settled = Some(false);
            if let Some(conn) = ledger.parked.take() {
                close(conn);
            }
        }
    }
}

impl std::ops::Deref for Lent {
    type Target = Conn;

    fn deref(&self) -> &Conn {
        self.conn.as_ref().expect("taken only by drop")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        let mut ledger = self.ledger.lock().unwrap_or_else(PoisonError::into_inner);
        match ledger.settled {
            Some(false) => close(conn),
            // Ended, or not known yet: the loan decides.
            Some(true) => drop(conn),
            None => ledger.parked = Some(conn),
        }
    }
}
