//! Field report 5's service: every request verifies its bearer JWT (HS512) and reads the row of
//! the token's `sid` from PostgreSQL, answering the row as JSON (401 without a valid token or
//! row, 503 when the database fails). One connection pool of 16, actix-web's default workers.
//!
//! Usage: sql-lookup PORT DATABASE_URL SECRET_FILE

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use jsonwebtoken::{decode, Algorithm, DecodingKey, Validation};
use serde::Deserialize;

#[derive(Deserialize)]
struct Claims {
    sid: String,
}

struct State {
    key: DecodingKey,
    validation: Validation,
    pool: sqlx::PgPool,
}

async fn lookup(req: HttpRequest, state: web::Data<State>) -> HttpResponse {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let Some(token) = token else {
        return HttpResponse::Unauthorized().finish();
    };
    let Ok(data) = decode::<Claims>(token, &state.key, &state.validation) else {
        return HttpResponse::Unauthorized().finish();
    };
    let row: Result<Option<(String, String)>, _> =
        sqlx::query_as("SELECT name, email FROM users WHERE sid = $1")
            .bind(&data.claims.sid)
            .fetch_optional(&state.pool)
            .await;
    match row {
        Ok(Some((name, email))) => {
            HttpResponse::Ok().json(serde_json::json!({ "name": name, "email": email }))
        }
        Ok(None) => HttpResponse::Unauthorized().finish(),
        Err(_) => HttpResponse::ServiceUnavailable().finish(),
    }
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, port, url, secret] = &args[..] else {
        eprintln!("usage: sql-lookup PORT DATABASE_URL SECRET_FILE");
        std::process::exit(2);
    };
    let secret = std::fs::read_to_string(secret)?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await
        .map_err(std::io::Error::other)?;
    let state = web::Data::new(State {
        key: DecodingKey::from_secret(secret.trim_end().as_bytes()),
        validation: Validation::new(Algorithm::HS512),
        pool,
    });
    HttpServer::new(move || App::new().app_data(state.clone()).default_service(web::to(lookup)))
        .bind(("127.0.0.1", port.parse::<u16>().expect("PORT")))?
        .run()
        .await
}
