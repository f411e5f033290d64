# bench/report.sh's chart: step time and peak memory per rank, one cluster
# per mode, one bar per rank count. Called as
#   gnuplot -e "datafile='X.dat'; outfile='X.png'; worlds='1 2'" bench/report_chart.gp
if (!exists("worlds")) worlds = "1 2"
set terminal pngcairo size 1200,460 font "sans,10" noenhanced
set output outfile
set multiplot layout 1,2 title "GPT-mini training step (bench/report.sh)"
set style data histogram
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set key outside bottom center horizontal
set grid ytics
set yrange [0:*]
set xtics nomirror rotate by -20
set title "Step time (ms, lower is better)"
set ylabel "ms per step"
plot for [i=1:words(worlds)] datafile using 2*i:xtic(1) title word(worlds, i)." rank(s)"
set title "Peak memory per rank (MiB)"
set ylabel "MiB"
plot for [i=1:words(worlds)] datafile using 2*i+1:xtic(1) title word(worlds, i)." rank(s)"
unset multiplot
