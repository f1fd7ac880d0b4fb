//! Sessions in the application's own table (`session.query`): tessera runs the configured
//! `SELECT` with the session's key as `$1` and takes the first column of the row as the record;
//! it writes nothing (its pooled connections are `default_transaction_read_only`), creates
//! nothing, and learns of changes only from the application's `NOTIFY` on
//! `session.notify_channel` (none: every request reads the table).

use tokio_postgres::types::{FromSql, Type};

use super::{err, PostgresStore, StoreError};
use crate::session::SessionQuery;

/// A record column as bytes: `bytea`, `text` (or `varchar`), `json` or `jsonb`.
struct Record(Vec<u8>);

impl<'a> FromSql<'a> for Record {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        // jsonb's binary form is a version byte (1) before the JSON text.
        let text = match *ty {
            Type::JSONB => match raw.split_first() {
                Some((1, json)) => json,
                _ => return Err("jsonb in an unknown binary version".into()),
            },
            _ => raw,
        };
        Ok(Self(text.to_vec()))
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::BYTEA | Type::TEXT | Type::VARCHAR | Type::JSON | Type::JSONB
        )
    }
}

impl PostgresStore {
    /// The record the configured query answers for `key`, `None` without a row or with a NULL
    /// record.
    pub(super) async fn get_own(
        &self,
        own: &SessionQuery,
        key: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let answer = self
            .run(|c| async move {
                let stmt = c.prepare_cached(&own.query).await?;
                // Checked before running, so that `check-config` (whose key finds no row)
                // names a query of the wrong shape too.
                if let Some(wrong) = misshapen(&stmt) {
                    return Ok(Err(wrong));
                }
                let row = c.query_opt(&stmt, &[&key]).await?;
                // A NULL record (an application that clears it at logout) is no session.
                let record = row.map(|r| r.try_get::<_, Option<Record>>(0)).transpose()?;
                Ok(Ok(record.flatten().map(|r| r.0)))
            })
            .await?;
        answer.map_err(err)
    }

    /// Whether the sessions are the application's (`session.query`): every write is refused.
    pub(crate) fn read_only(&self) -> bool {
        self.own.is_some()
    }

    /// Refuses a write when the sessions are the application's (`session.query`).
    pub(super) fn writable(&self) -> Result<(), StoreError> {
        match self.own {
            Some(_) => Err(err(
                "read-only: the sessions are the application's (session.query); it writes them",
            )),
            None => Ok(()),
        }
    }
}

/// Why `stmt` cannot be the session query: not one text parameter, or no record column first.
fn misshapen(stmt: &tokio_postgres::Statement) -> Option<String> {
    let column = stmt.columns().first().map(|c| c.type_());
    if let [param] = stmt.params() {
        if !matches!(
            *param,
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME
        ) {
            return Some(format!(
                "session.query takes $1 as {}, but the key is text: compare as text, e.g. \
                 `WHERE id::text = $1`",
                param.name()
            ));
        }
    }
    match (stmt.params().len(), column) {
        (1, Some(ty)) if <Record as FromSql>::accepts(ty) => None,
        (params, column) => Some(format!(
            "session.query must take one parameter ($1, the key) and answer the record as its \
             first column (bytea, text, json or jsonb): it takes {params} and answers {}",
            column.map_or("no column", |ty| ty.name())
        )),
    }
}
