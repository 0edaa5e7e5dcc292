#!/bin/sh
# A compiler that links libstdc++'s code into the shared libraries it links.
exec "${TEMPO_REAL_CXX:-g++}" "$@" -static-libstdc++
