package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// tally counts what the load saw; every field but the maps is updated atomically.
type tally struct {
	OK             int64 `json:"ok_200"`
	Unavailable    int64 `json:"unavailable_503_with_retry_after"`
	ValidRefused   int64 `json:"valid_session_401"`
	WrongUser      int64 `json:"wrong_user_body"`
	Transport      int64 `json:"transport_errors"`
	Logins         int64 `json:"logins"`
	LoginRetries   int64 `json:"login_retries"`
	Logouts        int64 `json:"logouts"`
	LogoutRetries  int64 `json:"logout_retries"`
	RevokedServed  int64 `json:"revoked_session_served"`
	RevokedRefused int64 `json:"revoked_session_401"`
	mu             sync.Mutex
	Other          map[string]int64 `json:"other_statuses"`
}

func (t *tally) other(what string) {
	t.mu.Lock()
	t.Other[what]++
	t.mu.Unlock()
}

// sample is the proxy process's resident memory and open files at a point of the run, with its
// TCP sockets by peer (client, upstream, store, other: listeners and the rest).
type sample struct {
	Requests int64          `json:"requests"`
	RSSKiB   int64          `json:"rss_kib"`
	Files    int            `json:"open_files"`
	Sockets  map[string]int `json:"tcp_sockets"`
}

// ports names the peers of tessera's sockets by port, for readSample.
var ports = map[string]string{}

// tcpSockets maps socket inodes to what their peer is (see ports), from /proc/PID/net/tcp{,6}.
func tcpSockets(pid int) map[string]string {
	kinds := map[string]string{}
	for _, f := range []string{"tcp", "tcp6"} {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, f))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(data), "\n")[1:] {
			fl := strings.Fields(l)
			if len(fl) < 10 {
				continue
			}
			port := func(addr string) string {
				_, hex, _ := strings.Cut(addr, ":")
				n, _ := strconv.ParseInt(hex, 16, 32)
				return strconv.FormatInt(n, 10)
			}
			kind := "other"
			if k, ok := ports["local:"+port(fl[1])]; ok && fl[3] != "0A" {
				kind = k
			} else if k, ok := ports["remote:"+port(fl[2])]; ok {
				kind = k
			}
			kinds[fl[9]] = kind
		}
	}
	return kinds
}

func readSample(pid int, requests int64) sample {
	s := sample{Requests: requests, Sockets: map[string]int{}}
	kinds := tcpSockets(pid)
	if status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for _, l := range strings.Split(string(status), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				s.RSSKiB, _ = strconv.ParseInt(f[1], 10, 64)
			}
		}
	}
	if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		s.Files = len(fds)
		for _, fd := range fds {
			link, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
			if inode, ok := strings.CutPrefix(link, "socket:["); ok {
				if kind, ok := kinds[strings.TrimSuffix(inode, "]")]; ok {
					s.Sockets[kind]++
				}
			}
		}
	}
	return s
}

type loader struct {
	base   string
	client *http.Client
	t      *tally
	done   atomic.Int64
	total  int64
	rotate int
}

// retryAfter waits what a 503's Retry-After says (at most 1 s: the soak wants load, not idle).
func retryAfter(resp *http.Response) {
	d := time.Second
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s < 1 {
		d = 200 * time.Millisecond
	}
	time.Sleep(d)
}

// login returns a fresh session's token for user, retrying while the store is down.
func (l *loader) login(c *http.Client, user string) string {
	body, _ := json.Marshal(map[string]string{"username": user, "password": password(user)})
	for {
		resp, err := c.Post(l.base+"/auth/login", "application/json", bytes.NewReader(body))
		if err != nil {
			atomic.AddInt64(&l.t.Transport, 1)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 {
			var v struct{ Token string }
			if json.Unmarshal(data, &v) == nil && v.Token != "" {
				atomic.AddInt64(&l.t.Logins, 1)
				return v.Token
			}
		}
		atomic.AddInt64(&l.t.LoginRetries, 1)
		if resp.StatusCode != 503 {
			l.t.other(fmt.Sprintf("login %d", resp.StatusCode))
		}
		retryAfter(resp)
	}
}

// logout ends the session, retrying while the store is down, then checks the token is refused.
func (l *loader) logout(c *http.Client, token string) {
	for {
		req, _ := http.NewRequest("POST", l.base+"/auth/logout", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := c.Do(req)
		if err != nil {
			atomic.AddInt64(&l.t.Transport, 1)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode/100 == 2 {
			atomic.AddInt64(&l.t.Logouts, 1)
			break
		}
		atomic.AddInt64(&l.t.LogoutRetries, 1)
		if resp.StatusCode != 503 {
			l.t.other(fmt.Sprintf("logout %d", resp.StatusCode))
		}
		retryAfter(resp)
	}
	code, resp := l.get(c, token, "/after-logout")
	if resp != nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	switch code {
	case 401:
		atomic.AddInt64(&l.t.RevokedRefused, 1)
	case 200:
		atomic.AddInt64(&l.t.RevokedServed, 1)
	case 0:
		atomic.AddInt64(&l.t.Transport, 1)
	default:
		l.t.other(fmt.Sprintf("after logout %d", code))
	}
}

func (l *loader) get(c *http.Client, token, path string) (int, *http.Response) {
	req, _ := http.NewRequest("GET", l.base+path, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil
	}
	return resp.StatusCode, resp
}

// client is worker n's HTTP client: one keep-alive connection from its own loopback address
// (127.0.x.y), as users come from their own addresses (tessera limits parallel logins per
// address).
func client(n int) *http.Client {
	local := &net.TCPAddr{IP: net.IPv4(127, 0, byte(1+n/250), byte(2+n%250))}
	dialer := &net.Dialer{LocalAddr: local, Timeout: 10 * time.Second}
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: dialer.DialContext, MaxIdleConnsPerHost: 1, DisableCompression: true}}
}

// worker logs in as user, sends `rotate` requests, logs out, and again, until the total is done.
func (l *loader) worker(c *http.Client, user string) {
	defer c.CloseIdleConnections()
	want := "user=" + user + "\n"
	for l.done.Load() < l.total {
		token := l.login(c, user)
		for i := 0; i < l.rotate && l.done.Add(1) <= l.total; i++ {
			code, resp := l.get(c, token, fmt.Sprintf("/soak/%d", i))
			if resp == nil {
				atomic.AddInt64(&l.t.Transport, 1)
				continue
			}
			data, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			switch {
			case code == 200 && string(data) == want:
				atomic.AddInt64(&l.t.OK, 1)
			case code == 200:
				atomic.AddInt64(&l.t.WrongUser, 1)
			case code == 503 && resp.Header.Get("Retry-After") != "":
				atomic.AddInt64(&l.t.Unavailable, 1)
				retryAfter(resp)
			case code == 401:
				atomic.AddInt64(&l.t.ValidRefused, 1)
			default:
				l.t.other(strconv.Itoa(code))
			}
		}
		l.logout(c, token)
	}
}

func runLoad(args []string) {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	base := fs.String("url", "", "tessera base URL")
	users := fs.Int("users", 64, "distinct users (one worker each)")
	total := fs.Int64("requests", 1_000_000, "requests in all")
	rotate := fs.Int("rotate", 2000, "requests per session before it is logged out and a new one made")
	restartCmd := fs.String("restart", "", "shell command that restarts the session store")
	restarts := fs.Int("restarts", 2, "store restarts, evenly spread over the run")
	pid := fs.Int("pid", 0, "tessera's PID (its RSS and open files are sampled)")
	upstream := fs.String("upstream", "", "upstream base URL (its /__soak/stats is read at the end)")
	storePort := fs.String("store-port", "", "the session store's port (names its sockets)")
	fs.Parse(args)
	t := &tally{Other: map[string]int64{}}
	portOf := func(u string) string { return u[strings.LastIndex(u, ":")+1:] }
	ports["local:"+portOf(*base)] = "client"
	ports["remote:"+portOf(*upstream)] = "upstream"
	ports["remote:"+*storePort] = "store"
	l := &loader{base: *base, t: t, total: *total, rotate: *rotate}
	var samples []sample
	var restartTimes []string
	started := time.Now()
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		nextSample, nextRestart := *total/10, 1
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			n := l.done.Load()
			if n >= nextSample && *pid > 0 {
				samples = append(samples, readSample(*pid, n))
				log.Printf("soak: %d requests, %s", n, time.Since(started).Round(time.Second))
				nextSample += *total / 10
			}
			if *restartCmd != "" && nextRestart <= *restarts &&
				n >= *total*int64(nextRestart)/int64(*restarts+1) {
				t0 := time.Now()
				out, err := exec.Command("sh", "-c", *restartCmd).CombinedOutput()
				if err != nil {
					log.Fatalf("soak: restart failed: %v: %s", err, out)
				}
				restartTimes = append(restartTimes, fmt.Sprintf("at %d requests, down %s", n, time.Since(t0).Round(time.Millisecond)))
				log.Printf("soak: store restarted (%s)", restartTimes[len(restartTimes)-1])
				nextRestart++
			}
		}
	}()
	var wg sync.WaitGroup
	for u := 0; u < *users; u++ {
		wg.Add(1)
		go func(n int) { defer wg.Done(); l.worker(client(n), fmt.Sprintf("u%d", n)) }(u)
	}
	wg.Wait()
	close(stop)
	<-stopped
	elapsed := time.Since(started)
	time.Sleep(2 * time.Second)
	final := sample{}
	if *pid > 0 {
		final = readSample(*pid, l.done.Load())
	}
	report := map[string]any{
		"requests": *total, "seconds": elapsed.Seconds(),
		"requests_per_second": float64(*total) / elapsed.Seconds(),
		"tally":               t, "restarts": restartTimes, "samples": samples,
		"final_after_clients_closed": final,
	}
	var st upstreamStats
	if *upstream != "" {
		resp, err := http.Get(*upstream + "/__soak/stats")
		if err != nil {
			fail("upstream stats: %v", err)
		}
		json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		report["upstream"] = st
	}
	out, _ := json.MarshalIndent(report, "", "  ")
	fmt.Println(string(out))
	if st.NoCredential > 0 {
		fail("%d requests reached the upstream without their credential", st.NoCredential)
	}
	checkTally(t, samples, final)
}

// checkTally ends the process with an error for any broken promise.
func checkTally(t *tally, samples []sample, final sample) {
	if t.ValidRefused > 0 || t.WrongUser > 0 || t.Transport > 0 || t.RevokedServed > 0 || len(t.Other) > 0 {
		fail("broken promises: %d valid-session 401s, %d wrong-user bodies, %d transport errors, %d revoked sessions served, other statuses %v",
			t.ValidRefused, t.WrongUser, t.Transport, t.RevokedServed, t.Other)
	}
	if len(samples) > 1 {
		// The first sample (10 %) is warm: every client connection and session exists.
		sorted := append([]sample(nil), samples...)
		sort.Slice(sorted, func(i, j int) bool { return sorted[i].Requests < sorted[j].Requests })
		base := sorted[0]
		if final.RSSKiB > base.RSSKiB*3/2+8*1024 {
			fail("RSS grew from %d KiB to %d KiB", base.RSSKiB, final.RSSKiB)
		}
		// Upstream connections come and go with the upstream's closes (at most
		// upstream.max_connections); every other file must be back where it was, less the
		// client connections now closed.
		steady := func(s sample) int { return s.Files - s.Sockets["upstream"] - s.Sockets["client"] }
		if steady(final) > steady(base) || final.Sockets["client"] > 0 {
			fail("open files grew: %+v at 10 %%, %+v at the end", base, final)
		}
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "soak: FAILED: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: soak upstream|load [flags]")
	}
	switch os.Args[1] {
	case "upstream":
		runUpstream(os.Args[2:])
	case "load":
		runLoad(os.Args[2:])
	default:
		fail("usage: soak upstream|load [flags]")
	}
}
