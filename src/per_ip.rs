//! Client connections per address (`server.max_connections_per_ip`, nginx's `limit_conn` on
//! `$binary_remote_addr`): one client cannot take every place under `server.max_connections`.
//! IPv6 clients count by their /64, one subscriber's prefix. A leaf module: the downstream
//! takes places at accept, the login limits share [`client_key`]. Must never: let one address
//! open more than its limit (a WebSocket tunnel taking over its connection's socket takes a
//! place past it, [`PerIp::enter_over`]), or keep an entry for an address with no connection.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The key a client address counts under: IPv6 by /64, IPv4 (and IPv4-mapped IPv6) as is.
pub fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

/// Open connections by client key, each at most `limit`.
#[derive(Debug)]
pub struct PerIp {
    limit: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
    /// Connections refused for being over the limit (since start).
    refused: AtomicU64,
}

/// A connection refused: its address holds its limit already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit;

/// A connection's place under its address's limit, given back when dropped.
#[derive(Debug)]
pub struct IpPlace {
    per_ip: Arc<PerIp>,
    key: IpAddr,
}

impl PerIp {
    /// At most `limit` (at least 1) connections per client key.
    pub fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            open: Mutex::new(HashMap::new()),
            refused: AtomicU64::new(0),
        }
    }

    /// A place for a connection from `ip`; `None` (counted) when its key holds `limit` already.
    pub fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<IpPlace> {
        let key = client_key(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(key).or_insert(0);
        if *n >= self.limit {
            drop(open);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *n += 1;
        Some(IpPlace {
            per_ip: self.clone(),
            key,
        })
    }

    /// A place for `ip` even past its limit: a WebSocket tunnel taking over its connection's
    /// socket, whose own place is given back when the connection's task ends.
    pub fn enter_over(self: &Arc<Self>, ip: IpAddr) -> IpPlace {
        let key = client_key(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        *open.entry(key).or_insert(0) += 1;
        IpPlace {
            per_ip: self.clone(),
            key,
        }
    }

    /// The per-address limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Connections refused for being over the limit, since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for IpPlace {
    fn drop(&mut self) {
        let mut open = self.per_ip.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_its_limit_and_gives_places_back() {
        let per_ip = Arc::new(PerIp::new(2));
        let a: IpAddr = "192.0.2.7".parse().unwrap();
        let (one, two) = (per_ip.enter(a).unwrap(), per_ip.enter(a).unwrap());
        assert!(per_ip.enter(a).is_none());
        assert_eq!(per_ip.refused(), 1);
        assert!(per_ip.enter("192.0.2.8".parse().unwrap()).is_some());
        drop(one);
        let three = per_ip.enter(a).unwrap();
        // A tunnel's place is taken past the limit, and counts until dropped.
        let over = per_ip.enter_over(a);
        drop((two, three));
        let four = per_ip.enter(a).unwrap();
        assert!(per_ip.enter(a).is_none(), "the tunnel's place counts");
        drop((four, over));
        assert!(
            per_ip.open.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }

    #[test]
    fn ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_key(a), client_key(b));
        assert_ne!(client_key(a), client_key(c));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(client_key(mapped), "192.0.2.7".parse::<IpAddr>().unwrap());
    }
}
