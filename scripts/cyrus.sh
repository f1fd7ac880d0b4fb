#!/usr/bin/env bash
# cyrus.sh - start/stop a private Cyrus IMAP 3.6 JMAP server for tessera's
# end-to-end tests (a real JMAP upstream behind the proxy).
#
#   scripts/cyrus.sh start DIR   fresh instance in DIR (wiped), users
#                                alice/alice-secret-1 and bob/bob-secret-2,
#                                one seeded message per INBOX; prints
#                                HTTP_PORT=, IMAP_PORT=, PID= on stdout.
#   scripts/cyrus.sh stop DIR    SIGTERM the instance's master (SIGKILL
#                                after 10 s); exit 0 if already stopped.
#   CYRUS_MAXCHILD=N             the http service's maxchild (default 8).
#   CYRUS_COMPRESS=yes           compress what clients ask to have compressed
#                                (httpallowcompress, Cyrus's default; default
#                                no here: jmapc saves downloads still compressed).
#
# Must run as root (master's children drop to user `cyrus`). Installs the
# Debian packages when missing. Every diagnostic goes to stderr; stdout
# carries only the three KEY=VALUE lines. Facts behind the configuration:
# /work/shared/docs/CYRUS-JMAP.md.
set -euo pipefail

CYRUS_BIN=/usr/lib/cyrus/bin
PACKAGES=(cyrus-common cyrus-caldav cyrus-imapd sasl2-bin curl)
USERS=(alice bob)
declare -A PASSWORDS=([alice]=alice-secret-1 [bob]=bob-secret-2)
REALM=localhost
MAXCHILD=${CYRUS_MAXCHILD:-8}
START_TIMEOUT=30
STOP_TIMEOUT=10
# Serialises port picking + binding between concurrent `start`s.
PORT_LOCK=/tmp/tessera-cyrus-ports.lock
# Marks a directory as a cyrus.sh instance, so `start` only ever wipes an
# empty directory or one of its own.
MARKER=.tessera-cyrus-instance

log() { printf 'cyrus.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    echo "usage: $0 start DIR | stop DIR" >&2
    exit 2
}

# Absolute, normalised path of $1 (which may not exist yet).
abspath() {
    local p=$1
    [[ $p == /* ]] || p="$PWD/$p"
    # Normalise without requiring existence.
    realpath -m -- "$p"
}

check_dir_sane() {
    case $1 in
        / | /root | /tmp | /home | /usr | /etc | /var | /work | /work/main)
            die "refusing to use $1 as instance directory" ;;
    esac
}

# --- processes of one instance ---------------------------------------------

# PIDs whose command line has this instance's imapd.conf as one argument
# (master and every child started with -C DIR/imapd.conf).
instance_pids() {
    local f pid
    # Pattern from a file so grep's own command line does not match.
    for f in $(grep -lzxF -f <(printf '%s' "$1") /proc/[0-9]*/cmdline 2>/dev/null); do
        pid=${f#/proc/}
        echo "${pid%/cmdline}"
    done
    return 0
}

alive() { kill -0 "$1" 2>/dev/null; }

# True while $1 exists and is not a zombie.
running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}

do_stop() {
    local dir conf pidfile pid pids deadline
    dir=$(abspath "$1")
    conf="$dir/imapd.conf"
    pidfile="$dir/run/master.pid"
    [[ -d $dir ]] || { log "stop: $dir does not exist; nothing to stop"; return 0; }

    pid=""
    if [[ -s $pidfile ]]; then
        pid=$(tr -dc '0-9' <"$pidfile")
    fi
    if [[ -n $pid ]] && alive "$pid" \
        && grep -qzxF -- "$conf" "/proc/$pid/cmdline" 2>/dev/null; then
        log "stop: SIGTERM master $pid"
        kill -TERM "$pid" 2>/dev/null || true
    else
        pid=""
    fi

    deadline=$((SECONDS + STOP_TIMEOUT))
    while :; do
        pids=$(instance_pids "$conf")
        [[ -z $pids ]] && { [[ -z $pid ]] || ! running "$pid"; } && break
        if ((SECONDS >= deadline)); then
            log "stop: still running after ${STOP_TIMEOUT}s, SIGKILL: $pid $pids"
            # shellcheck disable=SC2086
            kill -KILL $pid $pids 2>/dev/null || true
            sleep 0.2
            break
        fi
        # Children left behind by a dead master: terminate them too.
        if [[ -n $pids ]] && { [[ -z $pid ]] || ! running "$pid"; }; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
        fi
        sleep 0.1
    done
    rm -f "$pidfile"
    log "stop: instance in $dir stopped"
    return 0
}

# --- setup -----------------------------------------------------------------

ensure_packages() {
    local missing=0 f
    for f in "$CYRUS_BIN/master" "$CYRUS_BIN/httpd" "$CYRUS_BIN/imapd" \
        "$CYRUS_BIN/ctl_cyrusdb" /usr/sbin/saslpasswd2; do
        [[ -x $f ]] || missing=1
    done
    command -v curl >/dev/null || missing=1
    if ((missing)); then
        log "installing ${PACKAGES[*]}"
        if [[ ! -e /usr/sbin/policy-rc.d ]]; then
            # Keep Debian's own cyrus service from starting on install.
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
            chmod 755 /usr/sbin/policy-rc.d
        fi
        apt-get update >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${PACKAGES[@]}" >&2
    fi
    # Debian's own master would hold the standard ports; stop it.
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        systemctl disable --now cyrus-imapd >/dev/null 2>&1 || true
    fi
    if [[ -s /run/cyrus-master.pid ]]; then
        local dpid
        dpid=$(tr -dc '0-9' </run/cyrus-master.pid)
        if [[ -n $dpid ]] && alive "$dpid"; then
            log "stopping Debian's cyrus master ($dpid)"
            kill -TERM "$dpid" 2>/dev/null || true
            for _ in $(seq 50); do alive "$dpid" || break; sleep 0.1; done
        fi
    fi
}

# Two distinct free loopback TCP ports, "A B". Both sockets are bound at the
# same time so they differ; the caller holds PORT_LOCK until master listens.
pick_ports() {
    if command -v python3 >/dev/null; then
        python3 - <<'EOF'
import socket
a = socket.socket(); a.bind(("127.0.0.1", 0))
b = socket.socket(); b.bind(("127.0.0.1", 0))
print(a.getsockname()[1], b.getsockname()[1])
a.close(); b.close()
EOF
    else
        # Fallback without python: random ports below the ephemeral range
        # that nothing listens on.
        local ports=() p
        while ((${#ports[@]} < 2)); do
            p=$((20000 + RANDOM % 12000))
            [[ " ${ports[*]} " == *" $p "* ]] && continue
            if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
                ports+=("$p")
            fi
        done
        echo "${ports[0]} ${ports[1]}"
    fi
}

write_config() {
    local dir=$1 http_port=$2 imap_port=$3
    cat >"$dir/imapd.conf" <<EOF
configdirectory: $dir/conf
partition-default: $dir/spool
defaultpartition: default
proc_path: $dir/conf/proc
mboxname_lockpath: $dir/conf/lock
sievedir: $dir/sieve
lmtpsocket: $dir/conf/socket/lmtp
idlesocket: $dir/conf/socket/idle
notifysocket: $dir/conf/socket/notify
servername: $REALM
allowplaintext: yes
sasl_pwcheck_method: auxprop
sasl_auxprop_plugin: sasldb
sasl_sasldb_path: $dir/sasldb2
sasl_mech_list: PLAIN LOGIN
autocreate_quota: 0
autocreate_inbox_folders: Drafts | Sent | Trash
conversations: yes
conversations_db: twoskip
httpmodules: jmap
httpallowcompress: ${CYRUS_COMPRESS:-no}
EOF
    cat >"$dir/cyrus.conf" <<EOF
START {
  recover cmd="$CYRUS_BIN/ctl_cyrusdb -C $dir/imapd.conf -r"
}
SERVICES {
  imap cmd="$CYRUS_BIN/imapd -C $dir/imapd.conf" listen="127.0.0.1:$imap_port" prefork=0
  http cmd="$CYRUS_BIN/httpd -C $dir/imapd.conf" listen="127.0.0.1:$http_port" prefork=0 maxchild=$MAXCHILD
}
EVENTS {
  checkpoint cmd="$CYRUS_BIN/ctl_cyrusdb -C $dir/imapd.conf -c" period=30
}
EOF
}

# PIDs (space-separated) holding a listening socket on 127.0.0.1:$1, via ss.
listener_pids() {
    ss -Htlnp "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u | tr '\n' ' '
}

do_start() {
    local dir conf http_port imap_port master_pid code deadline u t0
    t0=$SECONDS
    ((EUID == 0)) || die "must run as root"
    dir=$(abspath "$1")
    check_dir_sane "$dir"
    conf="$dir/imapd.conf"
    # Unix sockets live in DIR; sun_path is limited to 108 bytes.
    ((${#dir} <= 80)) || die "DIR path too long for unix sockets (${#dir} > 80): $dir"

    ensure_packages

    # A previous instance in the same DIR would hold its files: stop it first.
    if [[ -d $dir ]]; then
        if [[ ! -e $dir/$MARKER && -n $(ls -A "$dir") ]]; then
            die "$dir is not empty and not a cyrus.sh instance; refusing to wipe it"
        fi
        do_stop "$dir"
        find "$dir" -mindepth 1 -delete
    fi
    mkdir -p "$dir"
    touch "$dir/$MARKER"
    mkdir -p "$dir"/conf/{db,socket,log,proc,lock,user,quota,msg} \
        "$dir/spool/stage." "$dir/sieve" "$dir/run" "$dir/log" "$dir/seed"

    # Users (realm must equal servername).
    for u in "${USERS[@]}"; do
        printf '%s' "${PASSWORDS[$u]}" |
            saslpasswd2 -f "$dir/sasldb2" -u "$REALM" -c -p "$u"
    done

    # Seed messages (CRLF line endings, as IMAP APPEND expects).
    for u in "${USERS[@]}"; do
        printf '%s\r\n' \
            "From: tessera-e2e <e2e@localhost>" \
            "To: $u <$u@localhost>" \
            "Subject: tessera e2e $u" \
            "Date: Mon, 01 Jan 2024 00:00:00 +0000" \
            "Message-ID: <tessera-e2e-$u@localhost>" \
            "MIME-Version: 1.0" \
            "Content-Type: text/plain; charset=us-ascii" \
            "" \
            "Seed message for $u." >"$dir/seed/$u.eml"
    done

    # Pick ports and start master while holding the lock, so that concurrent
    # starts cannot pick the same ports before either master has bound them.
    exec 9>>"$PORT_LOCK"
    flock 9
    read -r http_port imap_port < <(pick_ports)
    [[ -n $http_port && -n $imap_port ]] || die "could not pick free ports"
    write_config "$dir" "$http_port" "$imap_port"
    chown -R cyrus:mail "$dir"

    log "starting master in $dir (http $http_port, imap $imap_port)"
    # setsid: own session, survives the caller. All fds closed/redirected so
    # a caller capturing our stdout does not wait for master; fd 9 (the lock)
    # is not inherited.
    setsid "$CYRUS_BIN/master" -C "$conf" -M "$dir/cyrus.conf" \
        -p "$dir/run/master.pid" -L "$dir/log/master.log" \
        </dev/null >>"$dir/log/master.out" 2>&1 9>&- &
    local spawned=$!

    # Wait until JMAP answers 401 (unauthenticated) on our port.
    deadline=$((SECONDS + START_TIMEOUT))
    code=000
    while ((SECONDS < deadline)); do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 \
            "http://127.0.0.1:$http_port/jmap/" 2>/dev/null) || true
        [[ $code == 401 ]] && break
        if ! running "$spawned" && { [[ ! -s $dir/run/master.pid ]] ||
            ! running "$(tr -dc '0-9' <"$dir/run/master.pid")"; }; then
            log "master exited early"
            break
        fi
        sleep 0.1
    done
    master_pid=""
    [[ -s $dir/run/master.pid ]] && master_pid=$(tr -dc '0-9' <"$dir/run/master.pid")
    if [[ $code != 401 || -z $master_pid ]] || ! alive "$master_pid"; then
        flock -u 9; exec 9>&-
        log "master did not come up (timeout ${START_TIMEOUT}s, last HTTP code $code); note Cyrus itself logs only to syslog"
        {
            echo "--- $dir/log/master.log"; cat "$dir/log/master.log" 2>/dev/null || true
            echo "--- $dir/log/master.out"; cat "$dir/log/master.out" 2>/dev/null || true
        } >&2
        do_stop "$dir" || true
        exit 1
    fi
    # Make sure the port is really ours (not another process's listener).
    if command -v ss >/dev/null; then
        local owners
        owners=$(listener_pids "$http_port")
        if [[ -n $owners && " $owners " != *" $master_pid "* ]]; then
            flock -u 9; exec 9>&-
            log "port $http_port is held by pids $owners, not master $master_pid"
            do_stop "$dir" || true
            exit 1
        fi
    fi
    flock -u 9
    exec 9>&-

    # One IMAP login per user creates the INBOX (and autocreate folders);
    # then append the seed message.
    for u in "${USERS[@]}"; do
        curl -sS --fail --max-time 10 -u "$u:${PASSWORDS[$u]}" \
            "imap://127.0.0.1:$imap_port/" >/dev/null ||
            { do_stop "$dir"; die "IMAP login for $u failed"; }
        curl -sS --fail --max-time 10 -u "$u:${PASSWORDS[$u]}" \
            -T "$dir/seed/$u.eml" "imap://127.0.0.1:$imap_port/INBOX" >/dev/null ||
            { do_stop "$dir"; die "seeding INBOX of $u failed"; }
    done

    log "ready in $((SECONDS - t0))s: master $master_pid, http $http_port, imap $imap_port"
    printf 'HTTP_PORT=%s\nIMAP_PORT=%s\nPID=%s\n' "$http_port" "$imap_port" "$master_pid"
}

(($# == 2)) || usage
case $1 in
    start) do_start "$2" ;;
    stop) do_stop "$2" ;;
    *) usage ;;
esac
