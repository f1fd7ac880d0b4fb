package main

import (
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math/rand"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// upstreamStats is what the upstream saw, served at /__soak/stats.
type upstreamStats struct {
	Requests      int64 `json:"requests"`
	NoCredential  int64 `json:"forwarded_without_credential"`
	ClosedIdle    int64 `json:"idle_connections_closed"`
	ConnsAccepted int64 `json:"connections_accepted"`
}

// password is user's upstream password: the load's logins send the same.
func password(user string) string { return "pw-" + user }

// basicUser is the user of a valid `Authorization: Basic` value, or "".
func basicUser(h string) string {
	raw, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(h, "Basic "))
	if err != nil || !strings.HasPrefix(h, "Basic ") {
		return ""
	}
	user, pw, ok := strings.Cut(string(raw), ":")
	if !ok || !strings.HasPrefix(user, "u") || pw != password(user) {
		return ""
	}
	return user
}

// runUpstream serves Basic-authenticated users u<N> and, at random, closes keep-alive
// connections that went idle (the keep-alive race a proxy's pool must survive).
func runUpstream(args []string) {
	fs := flag.NewFlagSet("upstream", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "address")
	closeOneIn := fs.Int("close-one-in", 50, "close an idle keep-alive connection with probability 1/N")
	fs.Parse(args)
	var st upstreamStats
	var mu sync.Mutex
	idle := map[net.Conn]bool{}
	srv := &http.Server{
		Addr: *listen,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/__soak/stats" {
				json.NewEncoder(w).Encode(upstreamStats{
					Requests:      atomic.LoadInt64(&st.Requests),
					NoCredential:  atomic.LoadInt64(&st.NoCredential),
					ClosedIdle:    atomic.LoadInt64(&st.ClosedIdle),
					ConnsAccepted: atomic.LoadInt64(&st.ConnsAccepted),
				})
				return
			}
			atomic.AddInt64(&st.Requests, 1)
			user := basicUser(r.Header.Get("Authorization"))
			switch {
			case user == "" && r.URL.Path == "/check":
				w.Header().Set("WWW-Authenticate", `Basic realm="soak"`)
				w.WriteHeader(http.StatusUnauthorized)
			case user == "":
				atomic.AddInt64(&st.NoCredential, 1)
				w.WriteHeader(http.StatusForbidden)
				fmt.Fprint(w, "forwarded without its credential\n")
			default:
				fmt.Fprintf(w, "user=%s\n", user)
			}
		}),
		ConnState: func(c net.Conn, s http.ConnState) {
			mu.Lock()
			defer mu.Unlock()
			switch s {
			case http.StateNew:
				atomic.AddInt64(&st.ConnsAccepted, 1)
			case http.StateIdle:
				idle[c] = true
				if rand.Intn(*closeOneIn) == 0 {
					go func() {
						time.Sleep(time.Duration(rand.Intn(3000)) * time.Microsecond)
						mu.Lock()
						defer mu.Unlock()
						if idle[c] {
							atomic.AddInt64(&st.ClosedIdle, 1)
							c.Close()
						}
					}()
				}
				return
			case http.StateClosed, http.StateHijacked:
				delete(idle, c)
				return
			}
			idle[c] = false
		},
	}
	log.Fatal(srv.ListenAndServe())
}
