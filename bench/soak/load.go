package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
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

// sample is the proxy process's resident memory and open files at a point of the run.
type sample struct {
	Requests int64 `json:"requests"`
	RSSKiB   int64 `json:"rss_kib"`
	Files    int   `json:"open_files"`
}

func readSample(pid int, requests int64) sample {
	s := sample{Requests: requests}
	if status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for _, l := range strings.Split(string(status), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				s.RSSKiB, _ = strconv.ParseInt(f[1], 10, 64)
			}
		}
	}
	if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		s.Files = len(fds)
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
func (l *loader) login(user string) string {
	body, _ := json.Marshal(map[string]string{"username": user, "password": password(user)})
	for {
		resp, err := l.client.Post(l.base+"/auth/login", "application/json", bytes.NewReader(body))
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
func (l *loader) logout(token string) {
	for {
		req, _ := http.NewRequest("POST", l.base+"/auth/logout", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := l.client.Do(req)
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
	if code, _ := l.get(token, "/after-logout"); code == 401 {
		atomic.AddInt64(&l.t.RevokedRefused, 1)
	} else if code == 200 {
		atomic.AddInt64(&l.t.RevokedServed, 1)
	}
}

func (l *loader) get(token, path string) (int, *http.Response) {
	req, _ := http.NewRequest("GET", l.base+path, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := l.client.Do(req)
	if err != nil {
		return 0, nil
	}
	return resp.StatusCode, resp
}

// worker logs in as user, sends `rotate` requests, logs out, and again, until the total is done.
func (l *loader) worker(user string) {
	want := "user=" + user + "\n"
	for l.done.Load() < l.total {
		token := l.login(user)
		for i := 0; i < l.rotate && l.done.Add(1) <= l.total; i++ {
			code, resp := l.get(token, fmt.Sprintf("/soak/%d", i))
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
		l.logout(token)
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
	fs.Parse(args)
	t := &tally{Other: map[string]int64{}}
	l := &loader{base: *base, t: t, total: *total, rotate: *rotate,
		client: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
			MaxIdleConnsPerHost: *users, DisableCompression: true}}}
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
		go func(user string) { defer wg.Done(); l.worker(user) }(fmt.Sprintf("u%d", u))
	}
	wg.Wait()
	close(stop)
	<-stopped
	elapsed := time.Since(started)
	l.client.CloseIdleConnections()
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
		if final.Files > base.Files {
			fail("open files grew from %d to %d", base.Files, final.Files)
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
