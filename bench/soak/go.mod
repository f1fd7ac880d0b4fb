module tessera/bench/soak

go 1.22
