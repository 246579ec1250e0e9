package dev.hebrus.flywheel.capture;

import java.io.IOException;
import java.io.Reader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Properties;

/**
 * Java client properties from the librdkafka properties file that
 * {@code flywheel broker credentials --role runtime} prints
 * ({@code $FLYWHEEL_HOME/kafka/security/runtime.properties}):
 *
 * <pre>
 * security.protocol=SASL_SSL                 -&gt; security.protocol=SASL_SSL
 * sasl.mechanism=SCRAM-SHA-512               -&gt; sasl.mechanism=SCRAM-SHA-512
 * sasl.username / sasl.password              -&gt; sasl.jaas.config=...ScramLoginModule required username=.. password=..;
 * ssl.ca.location=&lt;ca.crt&gt;                   -&gt; ssl.truststore.type=PEM, ssl.truststore.location=&lt;ca.crt&gt;
 * ssl.endpoint.identification.algorithm=https -&gt; the same (Java's default)
 * </pre>
 *
 * Any other {@code key=value} is passed through unchanged (it must then be a Java client
 * property).
 */
public final class ClientProperties {
    private ClientProperties() {
    }

    public static Properties fromLibrdkafka(Path file, String bootstrap) throws IOException {
        Properties in = new Properties();
        try (Reader reader = Files.newBufferedReader(file, StandardCharsets.UTF_8)) {
            in.load(reader);
        }
        Properties out = new Properties();
        out.put("bootstrap.servers", bootstrap);
        String user = null;
        String password = null;
        for (String name : in.stringPropertyNames()) {
            String value = in.getProperty(name).trim();
            switch (name) {
                case "sasl.username" -> user = value;
                case "sasl.password" -> password = value;
                case "sasl.mechanisms", "sasl.mechanism" -> out.put("sasl.mechanism", value);
                case "ssl.ca.location" -> {
                    out.put("ssl.truststore.type", "PEM");
                    out.put("ssl.truststore.location", value);
                }
                case "bootstrap.servers" -> { }
                default -> out.put(name, value);
            }
        }
        if (user != null) {
            String module = "org.apache.kafka.common.security.scram.ScramLoginModule";
            out.put("sasl.jaas.config", module + " required username=\"" + escape(user)
                + "\" password=\"" + escape(password == null ? "" : password) + "\";");
        }
        return out;
    }

    private static String escape(String text) {
        return text.replace("\\", "\\\\").replace("\"", "\\\"");
    }
}
